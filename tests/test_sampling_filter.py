"""Top-k / top-p / min-p over candidates against the full-sort definition; the chunked noise against
the whole-row noise; and no full-vocabulary sort in a batch-64 step on a 151,936-token vocabulary."""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from kernels_fixtures import single_thread  # noqa: F401  (fixture)
from radixserve.kernels import sampling, sampling_noise
from radixserve.kernels.forward_io import PenaltyTokens, SeqInput
from radixserve.kernels.sampling_filter import candidate_keep, draw_filtered, reference_keep, top_candidates
from radixserve.kernels.sampling_noise import gumbel_argmax, gumbel_at, gumbel_rows, row_keys, seed_words
from radixserve.scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")
INF = float("inf")
# Few distinct values, so that ties (also across the candidates' edge) and p == 0 are common.
_VALUES = st.one_of(st.sampled_from([-INF, -30.0, -1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 5.0, 120.0]),
                    st.floats(-8, 8, width=32))


def _keys(seeds: list[int], positions: list[int]) -> torch.Tensor:
    return row_keys(*(torch.tensor(w) for w in seed_words(seeds, positions)))


def _reference_draw(x, key, k, top_p, min_p):
    keep = reference_keep(torch.softmax(x, dim=-1), k, top_p, min_p, x.shape[-1])
    return gumbel_argmax(x.masked_fill(~keep, -INF), key)


@st.composite
def batches(draw):
    vocab = draw(st.integers(1, 40))
    rows = draw(st.integers(1, 6))
    x = torch.tensor(draw(st.lists(st.lists(_VALUES, min_size=vocab, max_size=vocab), min_size=rows,
                                   max_size=rows)), dtype=torch.float32)
    x[:, 0] = torch.where(torch.isinf(x).all(dim=-1), 1.0, x[:, 0])  # rows have a finite token (an all -inf
    # row has NaN probabilities: it goes to the full sort, which is the reference itself)
    k = [kk if 0 < kk < vocab else vocab for kk in draw(st.lists(st.integers(-1, vocab + 2), min_size=rows,
                                                                   max_size=rows))]
    top_p = draw(st.lists(st.one_of(st.just(1.0), st.floats(0.01, 1.0)), min_size=rows, max_size=rows))
    min_p = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 1.0)), min_size=rows, max_size=rows))
    counts = draw(st.lists(st.integers(1, vocab), min_size=0, max_size=3))
    return (x, torch.tensor(k), torch.tensor(top_p) if any(p < 1 for p in top_p) else None,
            torch.tensor(min_p) if any(p > 0 for p in min_p) else None, counts)


@settings(max_examples=400, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**64 - 1))
def test_candidates_equal_the_full_sort(batch, seed):
    x, k, top_p, min_p, counts = batch
    note(f"x={x.tolist()} k={k.tolist()} top_p={top_p} min_p={min_p} counts={counts}")
    probs = torch.softmax(x, dim=-1)
    ref = reference_keep(probs, k, top_p, min_p, x.shape[-1]) & (probs > 0)  # p == 0 never drawn
    for count in counts:
        ok, ids, keep = candidate_keep(probs, k, top_p, min_p, count, x.shape[-1])
        for row in ok.nonzero().flatten().tolist():
            mine = {i for i, kept in zip(ids[row].tolist(), keep[row].tolist()) if kept and probs[row, i] > 0}
            assert mine == set(ref[row].nonzero().flatten().tolist()), (row, count)
    keys = _keys([seed + r for r in range(x.shape[0])], list(range(x.shape[0])))
    assert torch.equal(draw_filtered(x, keys, k, top_p, min_p, counts), _reference_draw(x, keys, k, top_p, min_p))


def test_rows_whose_nucleus_outgrows_the_candidates_take_the_full_sort():
    flat = torch.zeros(1, 64)  # top_p 0.9 keeps 58 tokens
    peaked = torch.full((1, 64), -20.0)
    peaked[0, [3, 9]] = 4.0
    x = torch.cat([flat, peaked])
    k, top_p = torch.tensor([64, 64]), torch.tensor([0.9, 0.9])
    ok, _, keep = candidate_keep(torch.softmax(x, dim=-1), k, top_p, None, 8, 64)
    assert ok.tolist() == [False, True] and keep[1].sum() == 2
    assert reference_keep(torch.softmax(x, dim=-1), k, top_p, None, 64)[0].sum() == 58
    for seed in range(20):
        keys = _keys([seed, seed], [0, 0])
        assert torch.equal(draw_filtered(x, keys, k, top_p, None, [8]), _reference_draw(x, keys, k, top_p, None))


def test_ties_at_the_top_k_edge_keep_the_lower_ids():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    keep = reference_keep(torch.softmax(x, dim=-1), torch.tensor([4]), None, None, 8)
    assert keep[0].nonzero().flatten().tolist() == [1, 2, 3, 4]  # 3.0 twice, then the first two 2.0s
    ok, ids, kept = candidate_keep(torch.softmax(x, dim=-1), torch.tensor([4]), None, None, 7, 8)
    assert ok.item() and ids[0][kept[0]].tolist() == [1, 3, 2, 4]
    # With 6 candidates the 2.0s reach the last one: topk may have cut their group, so the row is left
    # to a larger count (it holds all four here, but the candidates cannot know that).
    assert not candidate_keep(torch.softmax(x, dim=-1), torch.tensor([4]), None, None, 6, 8)[0].item()


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 4), blocks=st.integers(4, 120), width=st.sampled_from([16, 32, 64]),
       count=st.integers(1, 30), levels=st.integers(1, 6), seed=st.integers(0, 2**32), spread=st.booleans())
def test_two_stage_topk_finds_the_largest_values(rows, blocks, width, count, levels, seed, spread):
    vocab, count = blocks * width, max(1, min(count, blocks // 4))
    gen = torch.Generator().manual_seed(seed)  # few distinct values: ties across blocks are common
    probs = torch.randint(0, levels, (rows, vocab), generator=gen).float() / levels
    probs[torch.rand(rows, vocab, generator=gen) < 0.3] = 0.0
    if spread:  # the largest values one per block: every one of the `count` blocks is needed
        at = torch.randperm(blocks, generator=gen)[:count] * width + torch.randint(0, width, (count,), generator=gen)
        probs[:, at] = 2.0 + torch.arange(count, dtype=torch.float32)
    vals, ids = top_candidates(probs, count)
    expected = probs.topk(count, dim=-1).values
    assert torch.equal(vals, expected) and torch.equal(probs.gather(1, ids), vals)
    for row in range(rows):
        above = set((probs[row] > expected[row, -1]).nonzero().flatten().tolist())
        assert above <= set(ids[row].tolist()) and len(set(ids[row].tolist())) == count


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), vocab=st.integers(1, 1100), seed=st.integers(-2**63, 2**64 - 1),
       nan=st.booleans(), data=st.data())
def test_chunked_noise_equals_the_whole_rows(rows, vocab, seed, nan, data):
    lo, hi, pos = (torch.tensor(w) for w in seed_words([seed + r for r in range(rows)], list(range(rows))))
    with mock.patch.object(sampling_noise, "_CHUNK_ELEMENTS", 512):  # several chunks per row
        whole = gumbel_rows(lo, hi, pos, vocab)
        key = row_keys(lo, hi, pos)
        ids = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=rows * 3, max_size=rows * 3)))
        assert torch.equal(gumbel_at(key, ids.view(rows, 3)), whole.gather(1, ids.view(rows, 3)))
        x = torch.randint(-2, 2, (rows, vocab)).float() * 1e3  # ties of x + noise: the first maximum
        if nan:
            x[:, data.draw(st.integers(0, vocab - 1))] = float("nan")
        assert torch.equal(gumbel_argmax(x, key), (x + whole).argmax(dim=-1))
    with mock.patch.object(sampling_noise, "_CHUNK_ELEMENTS", 1 << 30):  # one chunk
        assert torch.equal(gumbel_rows(lo, hi, pos, vocab), whole)


# -- a real vocabulary ---------------------------------------------------------------------------

VOCAB = 151_936


def _real_batch() -> tuple[torch.Tensor, list[SeqInput]]:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, VOCAB, generator=gen) * 2.5
    logits[48:, :40] += 14.0  # peaked rows: their top_p nucleus is small
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.9),
             dict(temperature=1.0, min_p=0.2, repetition_penalty=1.3), dict(temperature=0.7, top_k=20, logprobs=3)]
    seqs = []
    for i in range(64):
        params = dict(temperature=1.0, top_p=0.95) if i >= 48 else kinds[i % 4]
        sampling = SamplingParams(**params).row_sampling()
        prompt = tuple(torch.randint(0, VOCAB, (300,), generator=gen).tolist())
        seqs.append(SeqInput(input_ids=[1], prefix_len=0, row=i, new_slots=[], slot_offset=0, sample=True,
                             new_row=True, sampling=sampling, sampling_seed=100 + i, sample_index=2,
                             penalty_tokens=PenaltyTokens(True, prompt, (5, 6)) if sampling.penalised else None,
                             num_top_logprobs=params.get("logprobs", 0)))
    return logits, seqs


class _Sorts:
    """Records the width of every sort / topk (Tensor methods and torch functions)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.widths: list[int] = []
        for owner in (torch, torch.Tensor):
            for name in ("sort", "argsort", "msort", "topk"):
                monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, fn, name):
        def recorded(t, *args, **kwargs):
            dim = kwargs.get("dim", args[1] if name == "topk" and len(args) > 1 else
                             args[0] if name != "topk" and args and isinstance(args[0], int) else -1)
            k = kwargs.get("k", args[0] if args else None) if name == "topk" else None
            self.widths.append(t.shape[dim] if k is None else k)
            return fn(t, *args, **kwargs)
        return recorded


def test_a_batch_64_step_sorts_no_row_of_the_vocabulary(monkeypatch):
    logits, seqs = _real_batch()
    reference, _ = _sample_with_full_sorts(monkeypatch, logits, seqs)
    sorts = _Sorts(monkeypatch)
    tokens, logprobs = sampling.sample_next_tokens(logits, seqs, native=True)
    assert sorts.widths and max(sorts.widths) <= 256  # candidates of 256 tokens, top_k 50 + 1, top logprobs
    assert tokens == reference
    assert [i for i, lp in enumerate(logprobs) if lp is not None] == list(range(3, 48, 4))
    logp = torch.log_softmax(logits[3:48:4], dim=-1)
    top = logp.topk(3, dim=-1)
    for row, lp in enumerate(logprobs[3:48:4]):
        assert lp.logprob == logp[row, lp.token_id].item()
        assert lp.top == list(zip(top.indices[row].tolist(), top.values[row].tolist()))


def test_a_flat_nucleus_is_sorted_and_the_recorder_sees_it(monkeypatch):
    """The check above can fail: a top_p row whose nucleus is most of the vocabulary sorts it."""
    logits = torch.zeros(1, VOCAB)
    seq = SeqInput(input_ids=[1], prefix_len=0, row=0, new_slots=[], slot_offset=0, sample=True, new_row=True,
                   sampling=SamplingParams(temperature=1.0, top_p=0.9).row_sampling(), sampling_seed=1)
    sorts = _Sorts(monkeypatch)
    sampling.sample_next_tokens(logits, [seq])
    assert max(sorts.widths) == VOCAB


def _sample_with_full_sorts(monkeypatch, logits, seqs):
    with monkeypatch.context() as patch:
        patch.setattr(sampling, "candidate_counts", lambda *args, **kwargs: [])  # straight to reference_keep
        return sampling.sample_next_tokens(logits, seqs)


def test_peaked_rows_are_decided_by_the_candidates():
    logits, seqs = _real_batch()
    probs = torch.softmax(logits[48:] / 1.0, dim=-1)
    ok, _, keep = candidate_keep(probs, torch.full((16,), VOCAB), torch.full((16,), 0.95), None, 256, VOCAB)
    assert ok.all() and keep.sum(dim=-1).max() <= 40
    assert math.isclose(probs[:, :40].sum(dim=-1).min().item(), 1.0, abs_tol=0.05)
