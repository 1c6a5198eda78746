"""PenaltyState (per-row penalty statistics kept between steps, fed by the scheduler's SlotRow) against the
stateless rebuild."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.kernels.forward_io import PenaltyTokens, SeqInput
from radixserve.kernels.sampling import PenaltyState, adjust_logits, sample_next_tokens
from radixserve.scheduler.sampling_params import SamplingParams
from radixserve.scheduler.slot_row import SlotRow, SlotRows

VOCAB = 64


class _Req:
    """A request's lists and its scheduler-side row (SlotRow), which decides what the penalty row is fed."""

    def __init__(self, rng: random.Random, **params):
        self.prompt_ids = [rng.randrange(-2, VOCAB + 2) for _ in range(rng.randrange(1, 24))]
        self.output_ids: list[int] = []
        self.params = SamplingParams(**params)
        self.seed = rng.randrange(2**31)
        self.kv = SlotRow()

    def place(self) -> None:
        """The scheduler gave the request a row (admission, or re-admission after a retraction)."""
        rows = SlotRows(1)
        rows.assign(self.kv, [])


def _seq(req: _Req, row: int, feed: PenaltyTokens | None) -> SeqInput:
    return SeqInput(input_ids=[1], prefix_len=0, row=row, new_slots=[], slot_offset=0, sample=True,
                    sampling=req.params.row_sampling(), sampling_seed=req.seed, sample_index=len(req.output_ids),
                    penalty_tokens=feed)


def _fed(req: _Req) -> PenaltyTokens | None:
    sampling = req.params.row_sampling()
    return req.kv.take_penalty_tokens(req.prompt_ids, req.output_ids) if sampling.penalised else None


def _full(req: _Req) -> PenaltyTokens:
    return PenaltyTokens(True, tuple(req.prompt_ids), tuple(req.output_ids))


def _step(state: PenaltyState, batch: list[tuple[_Req, int, bool]], seed: int) -> None:
    """One step with the state (fed by each request's SlotRow) and without (the whole context); both must agree
    exactly. `placed`: the request has just been given its row. Appends the sampled tokens."""
    for req, _, placed in batch:
        if placed:
            req.place()
    stateful = [_seq(req, row, _fed(req)) for req, row, _ in batch]
    stateless = [_seq(req, row, _full(req)) for req, row, _ in batch]
    logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    assert torch.equal(adjust_logits(logits, stateful, penalties=state), adjust_logits(logits, stateless))
    tokens, _ = sample_next_tokens(logits, stateless)
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
    # a finishes; e gets its row. b is retracted and comes back on c's row, outputs kept.
    e = _Req(rng, **both)
    _step(state, [(e, 0, True), (d, 3, False)], next(seed))
    for _ in range(2):
        _step(state, [(e, 0, False), (d, 3, False)], next(seed))
    assert b.output_ids
    _step(state, [(b, 2, True), (e, 0, False), (d, 3, False)], next(seed))
    for _ in range(4):
        _step(state, [(b, 2, False), (e, 0, False), (d, 3, False)], next(seed))
    # f (retracted earlier, more outputs than b had) gets b's old row 1, its first steps there prefill chunks
    # that sample nothing: its first sampled step is still a reset, because its row is new to it.
    f = _Req(rng, **both)
    f.output_ids.extend(rng.randrange(VOCAB) for _ in range(len(b.output_ids) + 3))
    f.place()
    for _ in range(3):
        _step(state, [(f, 1, False), (b, 2, False)], next(seed))
    # b retracted again and back on its row, then a penalty-free request on row 3 followed by a penalised one.
    _step(state, [(b, 2, True), (c, 3, True)], next(seed))
    _step(state, [(b, 2, False), (a, 3, True), (f, 1, False)], next(seed))
    _step(state, [(b, 2, False), (a, 3, False), (f, 1, False)], next(seed))
    assert state.num_updated_rows > state.num_rebuilt_rows


def test_a_row_new_to_a_request_is_fed_its_whole_context():
    rng = random.Random(3)
    req = _Req(rng, temperature=0.0, repetition_penalty=2.0)
    req.output_ids += [5, 6]
    req.place()
    first = _fed(req)
    assert first.reset and first.prompt == tuple(req.prompt_ids) and first.output == (5, 6)
    req.output_ids += [7, 8]
    assert _fed(req) == PenaltyTokens(False, (), (7, 8))
    assert _fed(req) == PenaltyTokens(False, (), ())  # nothing new since
    req.place()  # retracted and admitted again: the row's statistics start afresh
    assert _fed(req) == PenaltyTokens(True, tuple(req.prompt_ids), (5, 6, 7, 8))
    del req.output_ids[1:]  # fewer outputs than fed (never in the engine): a reset, never a negative slice
    assert _fed(req).reset


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
    lost = _Req(rng, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="no penalty_tokens"):
        adjust_logits(torch.zeros(1, VOCAB), [_seq(lost, 0, None)], penalties=state)
    with pytest.raises(ValueError, match="reset penalty_tokens"):
        adjust_logits(torch.zeros(1, VOCAB), [_seq(lost, 0, PenaltyTokens(False, (), (1,)))])


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
        if step == 0:
            for req in reqs:
                req.place()
        logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        expected = _dense_penalties(logits, reqs)
        assert torch.equal(adjust_logits(logits, [_seq(req, row, _full(req)) for row, req in enumerate(reqs)]),
                           expected)
        fed = [_seq(req, row, _fed(req)) for row, req in enumerate(reqs)]
        assert torch.equal(adjust_logits(logits, fed, penalties=state), expected)
