"""CPU cascade attention (``torch_backend.cascade_attention``) vs the plain reference
(``torch_ref.extend_attention``, in float64) on the same metadata, in fp32 and bf16, through both
readers: the native kernel (every build and QK^T path this CPU has, tests/_native_readers.py) and
its torch twin, the fallback where the kernel is not built (``partials.attend_tokens``).

Batches come from tests/_cascade_batches.py: a tree of shared prefixes whose members really hold
the same slots, every other position on slots of its own, pages placed as contiguous runs or
scattered. Slots nobody owns hold NaN (page 0 too, where the slot table's padding points), so any
read outside a sequence's keys makes the output non-finite; the reference reads the same pool
with NaN replaced by 0 (it pads its gathers with slot 0).

Tolerance: bf16 inputs are exact in float64 and both readers sum in fp32, so the error is fp32
accumulation (ATOL, as in fp32), on the native kernel's AMX tiles plus the rounding of P to bf16
(2^-8 * sum_j p_j |v_j|, _native_readers.p_rounding), and in bf16 the rounding of the result to
bf16 (2^-8 relative).
"""
from collections import Counter

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from _cascade_batches import make_shared_batch, shared_layout, shared_trees
from _native_readers import NEEDS_NATIVE, p_rounding, reader  # noqa: F401 (fixture)
from radixserve.kernels import native as native_kernel
from radixserve.kernels.attention import partials, torch_plan, torch_ref
from radixserve.kernels.attention.base import SharedPrefix
from radixserve.kernels.attention.torch_backend import TorchAttentionBackend, cascade_attention
from radixserve.kernels.attention.torch_plan import PAD_SLACK

ATOL = 1e-5
BF16_ROUNDING = 2.0 ** -8  # relative error of rounding to nearest bf16 (8 significant bits)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def twin(request) -> torch.dtype:
    """The torch twin reads (native=False), for q, K and V of this dtype."""
    return request.param


def _outputs(meta, k_cache, v_cache, q, window=None, native=None):
    sm_scale = q.shape[2] ** -0.5
    out = cascade_attention(q, k_cache, v_cache, meta, sm_scale, window, native=native)
    expected = torch_ref.extend_attention(q.double(), k_cache.double().nan_to_num(0.0),
                                          v_cache.double().nan_to_num(0.0), meta, sm_scale, window)
    return out, expected


def _check(meta, k_cache, v_cache, q, window=None, native=None):
    out, expected = _outputs(meta, k_cache, v_cache, q, window, native)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "read a slot outside the sequences' keys (NaN)"
    if native is None:
        native = native_kernel.supports(k_cache.dtype, k_cache.shape[2], k_cache.device)
    bound = torch.full_like(expected, ATOL)
    if native and p_rounding(q.dtype):  # sum_j p_j |v_j|: the same attention over |V|
        bound += p_rounding(q.dtype) * torch_ref.extend_attention(
            q.double(), k_cache.double().nan_to_num(0.0), v_cache.double().nan_to_num(0.0).abs(), meta,
            q.shape[2] ** -0.5, window)
    if q.dtype == torch.bfloat16:  # the result rounded to bf16
        bound += BF16_ROUNDING * (expected.abs() + bound)
    error = (out.double() - expected).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}, worst excess {(error - bound).max():.3g}"
    return out


def _plan(meta, group, window=None):
    return meta.step_cache[("torch_plan", window, group, bool(meta.shared) and window is None)]


def _buckets(meta, group, window=None):
    return _plan(meta, group, window).buckets


def _batch(own_cached, q_lens, groups, *, layout=None, group=1, num_kv_heads=2, head_dim=64, page_size=16,
           seed=0, dtype=torch.float32, **kw):
    if layout is None:
        layout = ["run"] * (len(groups) + len(q_lens))
    elif isinstance(layout, str):
        layout = [layout] * (len(groups) + len(q_lens))
    return make_shared_batch(own_cached, q_lens, groups, group=group, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, page_size=page_size, seed=seed,
                             layout=layout, **kw)


# -- the property ------------------------------------------------------------------------------

prefix_lens = st.one_of(st.just(1), st.integers(2, 40), st.sampled_from([16, 32]), st.integers(150, 320))
trees = shared_trees(lengths=prefix_lens, q_lens=st.one_of(st.just(1), st.integers(2, 24), st.just(64)),
                     own_cached=st.one_of(st.just(0), st.integers(1, 6), st.integers(7, 90)),
                     depths=st.integers(0, 3))
# Mostly no window (the cascade path); small and large windows take the plain path.
windows = st.one_of(st.none(), st.none(), st.none(), st.integers(1, 8), st.integers(64, 600))


def _property(native: bool, dtype: torch.dtype, max_examples: int) -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=max_examples, deadline=None)
    @given(tree=trees, data=st.data(), page_size=st.sampled_from([1, 16]), group=st.sampled_from([1, 4]),
           num_kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([64, 128]), window=windows,
           seed=st.integers(0, 2**16), query_block=st.sampled_from([torch_plan.QUERY_BLOCK, 5, 16]))
    def check(tree, data, page_size, group, num_kv_heads, head_dim, window, seed, query_block):
        torch_plan.QUERY_BLOCK = query_block  # small blocks: prefill chunks split into several units
        own_cached, q_lens, groups = tree
        layout = data.draw(st.lists(st.sampled_from(["run", "scatter"]), min_size=len(groups) + len(q_lens),
                                    max_size=len(groups) + len(q_lens)), label="layout")
        meta, k_cache, v_cache, q = _batch(own_cached, q_lens, groups, layout=layout, group=group,
                                           num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                                           seed=seed, dtype=dtype)
        _check(meta, k_cache, v_cache, q, window, native)
        plan = _plan(meta, group, window)
        tags = {"long": meta.max_kv_len >= 300, "padded queries": any(b.padded for b in plan.buckets),
                "prefill blocks": max(q_lens) > query_block, "nested levels": len(plan.shared_batches) > 1,
                "windowed" if window is not None else ("shared" if groups else "nothing shared"): True}
        note(f"tags: {sorted(t for t, on in tags.items() if on)}")
        seen.update(t for t, on in tags.items() if on)

    default_block = torch_plan.QUERY_BLOCK
    try:
        check()
    finally:
        torch_plan.QUERY_BLOCK = default_block
    # (Sibling prefixes in one call are rarer here: test_sibling_prefixes_share_one_call pins them.)
    for tag in ("long", "padded queries", "prefill blocks", "nested levels", "windowed", "shared", "nothing shared"):
        assert seen[tag], f"no example had {tag}: {dict(seen)}"


@NEEDS_NATIVE
def test_native_matches_reference_on_random_batches(reader):
    _property(True, reader, max_examples=200)


def test_torch_twin_matches_reference_on_random_batches(twin):
    _property(False, twin, max_examples=200)


# -- pinned edge cases (the reader the engine would use here: native where it builds) --------------

@pytest.mark.parametrize("groups", [[], [([0, 1, 2, 3], 21)]])
def test_equal_decodes_are_one_bucket(groups):
    meta, k_cache, v_cache, q = _batch([9, 9, 9, 9], [1, 1, 1, 1], groups, layout="scatter", group=4)
    _check(meta, k_cache, v_cache, q)
    (bucket,) = _buckets(meta, 4)
    assert (bucket.num, bucket.max_q, bucket.max_k, bucket.padded) == (4, 1, 10, False)
    lo, hi = bucket.bounds
    assert lo is None and hi.tolist() == [[10] * 4] * 4  # each stacked row (4 GQA heads) sees its 10 keys


def test_prefill_rows_see_keys_up_to_their_own():
    """A 12-token chunk after 30 cached tokens: query j sees keys [0, 31 + j); the bounds say so per
    stacked row (each token once per GQA head), and a window moves their start."""
    meta, k_cache, v_cache, q = _batch([30], [12], [], layout="scatter", page_size=1, group=2)
    _check(meta, k_cache, v_cache, q)
    (bucket,) = _buckets(meta, 2)
    assert bucket.tokens.tolist() == [list(range(12))] and bucket.max_k == 42
    assert bucket.bounds[0] is None and bucket.bounds[1].tolist() == [[31 + j // 2 for j in range(24)]]
    _check(meta, k_cache, v_cache, q, window=8)
    lo, hi = _buckets(meta, 2, window=8)[0].bounds
    assert torch.equal(lo, hi - 8)


def test_prefill_buckets_of_very_different_lengths_are_split():
    # Prefills: 64 new tokens over 64 own keys; 2 and 3 new tokens over 400 own keys each.
    # Decodes: own keys 1, 1 and 400.
    q_lens, own_cached = [64, 2, 3, 1, 1, 1], [0, 398, 397, 0, 0, 399]
    meta, k_cache, v_cache, q = _batch(own_cached, q_lens, [], layout="scatter", head_dim=128)
    _check(meta, k_cache, v_cache, q)
    buckets = _buckets(meta, 1)
    # Padding the long chunk to 400 keys would waste more than PAD_SLACK pairs per unit allows;
    # padding the short ones (or the 1-key decodes to 400) costs less than a separate call.
    assert 2 * 64 * 400 - (64 * 64 + 3 * 400) > PAD_SLACK * 2
    assert sorted((b.num, b.max_q, b.max_k) for b in buckets if b.max_q > 1) == [(1, 64, 64), (2, 3, 400)]
    (padded,) = [b for b in buckets if b.num == 2 and b.max_q == 3]
    assert padded.padded and int((padded.tokens >= 0).sum()) == 5  # 2 + 3 real queries of 6
    assert sorted((b.num, b.max_k) for b in buckets if b.max_q == 1) == [(3, 400)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_request_with_no_own_cached_tokens_below_a_shared_prefix(page_size):
    # seqs 0 and 1 have cached nothing past the 37 shared tokens: their own part is the new tokens.
    meta, k_cache, v_cache, q = _batch([0, 0, 5], [1, 6, 1], [([0, 1, 2], 37)], layout="scatter",
                                       page_size=page_size, group=4)
    _check(meta, k_cache, v_cache, q)
    assert meta.own_start_list == [37, 37, 37]
    # The decodes own 1 and 6 keys (one bucket), the prefill its 6 new ones.
    assert sorted((b.num, b.max_q, b.max_k) for b in _buckets(meta, 4)) == [(1, 6, 6), (2, 1, 6)]


def test_deep_chain_with_length_one_prefix_and_windows():
    groups = [([0, 1, 2, 3], 1), ([0, 1, 2], 200), ([1, 2], 17)]
    meta, k_cache, v_cache, q = _batch([3, 0, 8, 2], [5, 1, 1, 24], groups, layout="scatter", page_size=1,
                                       group=4, head_dim=128)
    assert meta.own_start_list == [201, 218, 218, 1]
    for window in (None, 1, 4, 100, 10_000):  # a window takes the plain path over every key
        _check(meta, k_cache, v_cache, q, window)
    # Nested prefixes share no call (a call merges a row once): one level each, outermost first.
    batches = _plan(meta, 4).shared_batches
    assert [b.tokens.shape[0] for b in batches] == [1, 1, 1]
    assert [int(b.bounds[1].max()) for b in batches] == [1, 200, 17]


def test_sibling_prefixes_share_one_call():
    groups = [([0, 1], 30), ([2, 3, 4], 50)]
    meta, k_cache, v_cache, q = _batch([2, 0, 1, 3, 0], [1, 4, 1, 1, 2], groups, layout="scatter", group=2)
    _check(meta, k_cache, v_cache, q)
    (batch,) = _plan(meta, 2).shared_batches
    qo = meta.qo_indptr.tolist()
    assert batch.tokens.tolist() == [list(range(qo[0], qo[2])), [*range(qo[2], qo[5]), -1]]  # 5 and 4 queries


@pytest.mark.parametrize("native", [pytest.param(True, marks=NEEDS_NATIVE), False], ids=["native", "twin"])
def test_backend_forward_stores_then_attends(native):
    meta, k_cache, v_cache, q = _batch([2, 0, 6], [3, 1, 1], [([0, 1, 2], 19), ([1, 2], 4)], group=4,
                                       layout="scatter")
    k_new, v_new = k_cache[meta.out_slot_ids].clone(), v_cache[meta.out_slot_ids].clone()
    k_cache[meta.out_slot_ids] = float("nan")  # forward must write them before reading
    v_cache[meta.out_slot_ids] = float("nan")
    out = TorchAttentionBackend(native=native).forward(q, k_new, v_new, k_cache, v_cache, meta,
                                                       q.shape[2] ** -0.5, None)
    torch.testing.assert_close(out.double(), _outputs(meta, k_cache, v_cache, q)[1], atol=ATOL, rtol=0)


# -- the comparison can fail ------------------------------------------------------------------

def test_false_sharing_is_caught():
    """A SharedPrefix over positions whose slots in fact differ per sequence: the cascade reads
    seq 0's keys for seq 1's queries, and the comparison must see it."""
    own_cached, q_lens = [10, 10, 4], [2, 1, 3]
    meta, k_cache, v_cache, q = _batch(own_cached, q_lens, [], layout="scatter",
                                       shared=[SharedPrefix(0, 8, [0, 1])])
    slots = meta.slot_table
    assert not torch.equal(slots[0, :8], slots[1, :8]), "the claimed sharing must be false"
    out, expected = _outputs(meta, k_cache, v_cache, q)
    out = out.double()
    assert torch.isfinite(out).all()
    assert not torch.allclose(out, expected, atol=1e-3, rtol=0)
    rows = meta.qo_indptr.tolist()
    # Seq 0's own slots are the ones read; seq 1 (wrong keys) differs; seq 2 is untouched.
    torch.testing.assert_close(out[rows[0]:rows[1]], expected[rows[0]:rows[1]], atol=ATOL, rtol=0)
    assert not torch.allclose(out[rows[1]:rows[2]], expected[rows[1]:rows[2]], atol=1e-3, rtol=0)
    torch.testing.assert_close(out[rows[2]:], expected[rows[2]:], atol=ATOL, rtol=0)


def test_dropping_the_shared_part_or_reading_past_a_row_is_caught(monkeypatch):
    groups = [([0, 1, 2], 21)]
    meta, k_cache, v_cache, q = _batch([3, 0, 2], [4, 1, 1], groups, layout="scatter")
    with monkeypatch.context() as m:
        # The shared part never merged in: each row keeps its own part only.
        def no_merge(*args, merge):
            if not merge:
                attend_tokens(*args, merge=merge)
        attend_tokens = partials.attend_tokens
        m.setattr(partials, "attend_tokens", no_merge)
        out, expected = _outputs(meta, k_cache, v_cache, q, native=False)
        assert not torch.allclose(out.double(), expected, atol=1e-3, rtol=0)
    # One key too many for seq 1: the slot table's padding (slot 0, never handed out) is NaN.
    _, prefix_lens, _ = shared_layout([3, 0, 2], [4, 1, 1], groups)
    meta.kv_lens_list[1] += 1
    meta.step_cache.clear()
    for native in (False, *([True] if native_kernel.cannot_build() is None else [])):
        meta.step_cache.clear()
        out = cascade_attention(q, k_cache, v_cache, meta, 0.125, native=native)
        assert not torch.isfinite(out).all()
    assert meta.slot_table[1, prefix_lens[1] + 1] == 0 and torch.isnan(k_cache[0]).all()


def test_long_prefill_chunk_is_cut_into_causal_blocks():
    """A 600-query chunk after 40 cached own tokens: units of QUERY_BLOCK queries, each seeing
    only the keys up to its last query (the causal triangle past each block is skipped)."""
    meta, k_cache, v_cache, q = _batch([40, 3], [600, 1], [([0, 1], 17)], layout="run", page_size=1)
    _check(meta, k_cache, v_cache, q)
    prefill = [b for b in _buckets(meta, 1) if b.max_q > 1]
    block = torch_plan.QUERY_BLOCK
    assert sorted(b.max_q for b in prefill) == sorted([block, block, 600 - 2 * block])
    assert sorted(b.max_k for b in prefill) == [40 + block, 40 + 2 * block, 40 + 600]
    assert all(b.num == 1 for b in prefill)  # long blocks are not padded together
