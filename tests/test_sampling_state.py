"""PenaltyState (per-row penalty statistics kept between steps) against the stateless rebuild."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.kernels.forward_io import SeqInput
from radixserve.kernels.sampling import PenaltyState, adjust_logits, sample_next_tokens
from radixserve.scheduler.sampling_params import SamplingParams

VOCAB = 64


class _Req:
    """The lists a request owns; SeqInputs reference them (never copies), as the engine's do."""

    def __init__(self, rng: random.Random, **params):
        self.prompt_ids = [rng.randrange(-2, VOCAB + 2) for _ in range(rng.randrange(1, 24))]
        self.output_ids: list[int] = []
        self.params = SamplingParams(**params)
        self.seed = rng.randrange(2**31)


def _seq(req: _Req, row: int, new_row: bool) -> SeqInput:
    return SeqInput(input_ids=[1], prefix_len=0, row=row, new_slots=[], slot_offset=0, sample=True,
                    new_row=new_row, sampling=req.params.row_sampling(), sampling_seed=req.seed,
                    prompt_ids=req.prompt_ids, output_ids=req.output_ids)


def _step(state: PenaltyState, batch: list[tuple[_Req, int, bool]], seed: int) -> None:
    """One step with the state and without; both must agree exactly. Appends the tokens."""
    seqs = [_seq(req, row, new_row) for req, row, new_row in batch]
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    assert torch.equal(adjust_logits(logits, seqs, penalties=state), adjust_logits(logits, seqs))
    tokens, _ = sample_next_tokens(logits, seqs, penalties=state)  # a second update: idempotent
    assert tokens == sample_next_tokens(logits, seqs)[0]
    for (req, _, _), token in zip(batch, tokens):
        req.output_ids.append(token)


def test_penalty_state_equals_the_stateless_rebuild_over_many_steps():
    rng = random.Random(0)
    rep = {"temperature": 1.3, "repetition_penalty": 1.7}
    both = {"temperature": 0.0, "repetition_penalty": 0.6, "frequency_penalty": 0.4, "presence_penalty": 0.9}
    a, b, c = _Req(rng, **rep), _Req(rng, **both), _Req(rng, temperature=0.9)
    d = _Req(rng, temperature=1.0, frequency_penalty=-0.3, top_p=0.8)
    state = PenaltyState(num_rows=4)
    seed = iter(range(10**6))
    _step(state, [(a, 0, True), (b, 1, True), (c, 2, True), (d, 3, True)], next(seed))
    for _ in range(6):
        _step(state, [(a, 0, False), (b, 1, False), (c, 2, False), (d, 3, False)], next(seed))
    assert state.num_updated_rows > 0
    # a finishes; e gets its row (new_row). b is retracted and comes back on c's row, outputs kept.
    e = _Req(rng, **both)
    for _ in range(3):
        _step(state, [(e, 0, not e.output_ids), (d, 3, False)], next(seed))
    assert b.output_ids
    _step(state, [(b, 2, True), (e, 0, False), (d, 3, False)], next(seed))
    for _ in range(4):
        _step(state, [(b, 2, False), (e, 0, False), (d, 3, False)], next(seed))
    # f (retracted earlier, more outputs than b had) reuses b's old row 1, but its new_row step was
    # a prefill chunk that sampled nothing: the state sees new_row False with another request's
    # list and must rebuild anyway.
    f = _Req(rng, **both)
    f.output_ids.extend(rng.randrange(VOCAB) for _ in range(len(b.output_ids) + 3))
    for _ in range(3):
        _step(state, [(f, 1, False), (b, 2, False)], next(seed))
    # b retracted again and back on its row, new_row set, then a penalty-free request on row 3
    # followed by a penalised one whose list the state has seen before on another row.
    _step(state, [(b, 2, True), (c, 3, True)], next(seed))
    _step(state, [(b, 2, False), (a, 3, False), (f, 1, False)], next(seed))
    _step(state, [(b, 2, False), (a, 3, False), (f, 1, False)], next(seed))
    assert state.num_updated_rows > state.num_rebuilt_rows


def test_new_row_rebuilds_even_when_the_list_object_is_reused():
    rng = random.Random(3)
    first = _Req(rng, temperature=0.0, repetition_penalty=2.0)
    state = PenaltyState(num_rows=1)
    _step(state, [(first, 0, True)], 0)
    second = _Req(rng, temperature=0.0, repetition_penalty=2.0)
    second.output_ids = first.output_ids  # a caller recycling list objects: only new_row tells
    second.output_ids.clear()
    _step(state, [(second, 0, True)], 1)
    _step(state, [(second, 0, False)], 2)


def test_output_shorter_than_recorded_rebuilds_the_row():
    rng = random.Random(1)
    req = _Req(rng, temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.5)
    state = PenaltyState(num_rows=2)
    for step in range(4):
        _step(state, [(req, 1, step == 0)], step)
    del req.output_ids[1:]  # a caller trimmed the list in place
    rebuilt = state.num_rebuilt_rows
    _step(state, [(req, 1, False)], 9)
    assert state.num_rebuilt_rows == rebuilt + 2  # both statistics


def test_no_tensor_until_a_penalty_is_used_and_rows_are_checked():
    rng = random.Random(2)
    plain = _Req(rng, temperature=0.7)
    state = PenaltyState(num_rows=2)
    _step(state, [(plain, 0, True)], 0)
    assert state.seen is None and state.counts is None
    _step(state, [(_Req(rng, presence_penalty=0.5), 1, True)], 1)
    assert state.seen is None and state.counts is not None and state.counts.shape == (2, VOCAB)
    with pytest.raises(ValueError, match="row 2"):
        _step(state, [(_Req(rng, repetition_penalty=1.2), 2, True)], 2)


def _dense_penalties(logits: torch.Tensor, reqs: list[_Req]) -> torch.Tensor:
    """The penalties as whole-row formulas (what the sparse update must equal, bit for bit)."""
    out = logits.clone()
    for i, req in enumerate(reqs):
        seen = torch.zeros(VOCAB, dtype=torch.bool)
        counts = torch.zeros(VOCAB)
        for tok in req.prompt_ids + req.output_ids:
            if 0 <= tok < VOCAB:
                seen[tok] = True
        for tok in req.output_ids:
            if 0 <= tok < VOCAB:
                counts[tok] += 1
        p = req.params
        row = torch.where(seen, torch.where(out[i] < 0, out[i] * p.repetition_penalty,
                                            out[i] / p.repetition_penalty), out[i])
        out[i] = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return out


def test_sparse_penalties_equal_the_whole_row_formulas():
    rng = random.Random(5)
    reqs = [_Req(rng, repetition_penalty=1.6, frequency_penalty=0.7), _Req(rng, temperature=0.5),
            _Req(rng, presence_penalty=-0.4, repetition_penalty=0.8), _Req(rng, frequency_penalty=1.1)]
    state = PenaltyState(num_rows=4)
    for step in range(5):
        for req in reqs:
            req.output_ids += [rng.randrange(-1, VOCAB + 1) for _ in range(rng.randrange(0, 4))]
        seqs = [_seq(req, row, step == 0) for row, req in enumerate(reqs)]
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        expected = _dense_penalties(logits, reqs)
        assert torch.equal(adjust_logits(logits, seqs), expected)
        assert torch.equal(adjust_logits(logits, seqs, penalties=state), expected)
