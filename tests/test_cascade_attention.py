"""CPU cascade attention (``torch_backend.cascade_attention``) vs the plain reference
(``torch_ref.extend_attention``) on the same metadata, fp32.

Batches come from tests/_cascade_batches.py: a tree of shared prefixes whose members really hold
the same slots, every other position on slots of its own, pages placed as contiguous runs or
scattered, so both the view and the gather paths of shared prefixes and of single-sequence own
parts run. Slots nobody owns hold NaN (page 0 too, where the slot table's padding points), so any
read outside a sequence's keys makes the output non-finite; the reference reads the same pool
with NaN replaced by 0 (it pads its gathers with slot 0).
"""
from collections import Counter

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from _cascade_batches import make_shared_batch, shared_layout, shared_trees
from radixserve.kernels import native as native_kernel
from radixserve.kernels.attention import torch_backend, torch_plan, torch_ref
from radixserve.kernels.attention.base import SharedPrefix
from radixserve.kernels.attention.torch_backend import TorchAttentionBackend, cascade_attention
from radixserve.kernels.attention.torch_plan import PAD_SLACK

# Both read paths: torch's flash op (everywhere) and the native kernel (wherever a C compiler is:
# a build that fails fails the native cases rather than skipping them).
needs_native = pytest.mark.skipif(native_kernel.cannot_build() is not None, reason=f"{native_kernel.cannot_build()}")
READERS = [False, pytest.param(True, marks=needs_native, id="native")]

ATOL = 1e-5


def _outputs(meta, k_cache, v_cache, q, window=None, native=False):
    sm_scale = q.shape[2] ** -0.5
    out = cascade_attention(q, k_cache, v_cache, meta, sm_scale, window, native=native)
    expected = torch_ref.extend_attention(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), meta, sm_scale,
                                          window)
    return out, expected


def _check(meta, k_cache, v_cache, q, window=None, native=False):
    out, expected = _outputs(meta, k_cache, v_cache, q, window, native)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all(), "read a slot outside the sequences' keys (NaN)"
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    return out


def _buckets(meta, group, window=None, native=False):
    use_shared = bool(meta.shared) and window is None
    return meta.step_cache[("torch_plan", window, group, use_shared, native)].buckets


def _paths(meta, group, window=None, native=False) -> set[str]:
    """Which read paths the last cascade_attention call on meta took."""
    paths = set()
    if window is None:
        paths |= {"shared_view" if p.runs is not None else "shared_gather" for p in meta.shared}
    for b in _buckets(meta, group, window, native):
        if b.num == 1:
            paths.add("own_view" if b.kv_idx is None else "own_gather")
    return paths


def _batch(own_cached, q_lens, groups, *, layout=None, group=1, num_kv_heads=2, head_dim=64, page_size=16,
           seed=0, **kw):
    if layout is None:
        layout = ["run"] * (len(groups) + len(q_lens))
    elif isinstance(layout, str):
        layout = [layout] * (len(groups) + len(q_lens))
    return make_shared_batch(own_cached, q_lens, groups, group=group, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=torch.float32, page_size=page_size, seed=seed,
                             layout=layout, **kw)


# -- the property ------------------------------------------------------------------------------

prefix_lens = st.one_of(st.just(1), st.integers(2, 40), st.sampled_from([16, 32]), st.integers(150, 320))
trees = shared_trees(lengths=prefix_lens, q_lens=st.one_of(st.just(1), st.integers(2, 24), st.just(64)),
                     own_cached=st.one_of(st.just(0), st.integers(1, 6), st.integers(7, 90)),
                     depths=st.integers(0, 3))
# Mostly no window (the cascade path); small and large windows take the plain path.
windows = st.one_of(st.none(), st.none(), st.none(), st.integers(1, 8), st.integers(64, 600))


@pytest.mark.parametrize("native", READERS)
def test_cascade_matches_reference_on_random_batches(native):
    seen: Counter[str] = Counter()

    @settings(max_examples=200, deadline=None)
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
                                           seed=seed)
        _check(meta, k_cache, v_cache, q, window, native)
        paths = _paths(meta, group, window, native)
        note(f"paths: {sorted(paths)}")
        seen.update(paths)
        seen["long"] += meta.max_kv_len >= 300
        seen["padded queries"] += any(b.valid is not None for b in _buckets(meta, group, window, native))
        seen["windowed" if window is not None else ("shared" if groups else "nothing shared")] += 1

    default_block = torch_plan.QUERY_BLOCK
    try:
        check()
    finally:
        torch_plan.QUERY_BLOCK = default_block
    # The native kernel reads every range by slot: no views, nothing gathered.
    views = ("shared_view", "own_view") if not native else ()
    for path in (*views, "shared_gather", "own_gather", "windowed", "shared", "nothing shared", "long",
                 "padded queries"):
        assert seen[path], f"no example took the {path} path: {dict(seen)}"


# -- pinned edge cases --------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [[], [([0, 1, 2, 3], 21)]])
def test_equal_decodes_are_one_bucket(groups):
    meta, k_cache, v_cache, q = _batch([9, 9, 9, 9], [1, 1, 1, 1], groups, layout="scatter", group=4)
    _check(meta, k_cache, v_cache, q)
    (bucket,) = _buckets(meta, 4)
    assert bucket.num == 4 and bucket.max_q == 1 and bucket.valid is None  # no padded query
    # Gathered keys are padded to whole blocks of the op; the mask hides exactly the padding.
    assert bucket.max_k == torch_plan.KEY_ALIGN * -(-10 // torch_plan.KEY_ALIGN)
    hidden = torch.isinf(bucket.mask[:, 0]).all(dim=1)  # [num, max_k]: hidden from every query
    assert hidden[:, :10].sum() == 0 and hidden[:, 10:].all()


def test_single_prefill_with_contiguous_own_keys_is_a_view():
    meta, k_cache, v_cache, q = _batch([30], [12], [], layout=["run"], page_size=1)
    _check(meta, k_cache, v_cache, q)
    (bucket,) = _buckets(meta, 1)
    assert bucket.kv_idx is None and bucket.max_k == 42
    assert bucket.mask is not None  # causal among the new tokens
    # The same batch on scattered slots gathers, with the same result.
    meta2, k2, v2, q2 = _batch([30], [12], [], layout=["scatter"], page_size=1)
    _check(meta2, k2, v2, q2)
    assert _buckets(meta2, 1)[0].kv_idx is not None


def test_prefill_next_to_decodes_below_a_shared_prefix_reads_its_own_keys_as_a_view():
    # seq 0 decodes, seq 1 prefills; both below a 37-token prefix read once (a view).
    meta, k_cache, v_cache, q = _batch([4, 20], [1, 9], [([0, 1], 37)], layout="run", group=4)
    _check(meta, k_cache, v_cache, q)
    assert meta.own_start_list == [37, 37]
    assert _paths(meta, 4) == {"shared_view", "own_view"}


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
    assert padded.valid is not None and int(padded.valid.sum()) == 5  # 2 + 3 real queries of 6
    assert sorted((b.num, b.max_k) for b in buckets if b.max_q == 1) == [(3, 400)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_request_with_no_own_cached_tokens_below_a_shared_prefix(page_size):
    # seqs 0 and 1 have cached nothing past the 37 shared tokens: their own part is the new tokens.
    meta, k_cache, v_cache, q = _batch([0, 0, 5], [1, 6, 1], [([0, 1, 2], 37)], layout="scatter",
                                       page_size=page_size, group=4)
    _check(meta, k_cache, v_cache, q)
    assert meta.own_start_list == [37, 37, 37]
    # The decodes own 1 and 6 keys (one gathered bucket, padded to a whole key block), the
    # prefill its 6 new ones (few runs of the pool: views, not padded).
    align = torch_plan.KEY_ALIGN
    assert sorted((b.num, b.max_q, b.max_k) for b in _buckets(meta, 4)) == [(1, 6, 6), (2, 1, align)]


def test_deep_chain_with_length_one_prefix_and_windows():
    groups = [([0, 1, 2, 3], 1), ([0, 1, 2], 200), ([1, 2], 17)]
    meta, k_cache, v_cache, q = _batch([3, 0, 8, 2], [5, 1, 1, 24], groups, layout="scatter", page_size=1,
                                       group=4, head_dim=128)
    assert meta.own_start_list == [201, 218, 218, 1]
    for window in (None, 1, 4, 100, 10_000):  # a window takes the plain path over every key
        _check(meta, k_cache, v_cache, q, window)
    # Length 1 is trivially contiguous (a view); the others lie on scattered slots (gathered).
    assert [p.contiguous_start is not None for p in meta.shared] == [True, False, False]


def test_backend_forward_stores_then_attends():
    meta, k_cache, v_cache, q = _batch([2, 0, 6], [3, 1, 1], [([0, 1, 2], 19), ([1, 2], 4)], group=4,
                                       layout="scatter")
    k_new, v_new = k_cache[meta.out_slot_ids].clone(), v_cache[meta.out_slot_ids].clone()
    k_cache[meta.out_slot_ids] = float("nan")  # forward must write them before reading
    v_cache[meta.out_slot_ids] = float("nan")
    out = TorchAttentionBackend().forward(q, k_new, v_new, k_cache, v_cache, meta, q.shape[2] ** -0.5, None)
    torch.testing.assert_close(out, _outputs(meta, k_cache, v_cache, q)[1], atol=ATOL, rtol=0)


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
        # The shared part read but weighed as nothing (lse -inf): the merge keeps the own part only.
        def dropped(*args):
            o, lse = shared_attention(*args)
            return o, torch.full_like(lse, float("-inf"))
        shared_attention = torch_backend._shared_attention
        m.setattr(torch_backend, "_shared_attention", dropped)
        out, expected = _outputs(meta, k_cache, v_cache, q)
        assert not torch.allclose(out, expected, atol=1e-3, rtol=0)
    # One key too many for seq 1: the slot table's padding (slot 0, never handed out) is NaN.
    _, prefix_lens, _ = shared_layout([3, 0, 2], [4, 1, 1], groups)
    meta.kv_lens_list[1] += 1
    meta.step_cache.clear()
    out = cascade_attention(q, k_cache, v_cache, meta, 0.125)
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 6), st.sampled_from([0, 0, 1, 5, -20])), min_size=1, max_size=8),
                min_size=1, max_size=5), st.integers(1, 4))
def test_runs_of_all_prefixes_at_once_equal_each_alone(pieces, max_runs):
    """metadata._runs_of_each (one pass over every shared prefix of a step) = slot_runs per prefix:
    runs never cross from one prefix into the next, even where the slots happen to continue."""
    from radixserve.kernels.attention.metadata import _runs_of_each, slot_runs
    tensors, base = [], 50
    for runs in pieces:
        slots = []
        for length, gap in runs:
            slots.extend(range(base, base + length))
            base += length + gap
        tensors.append(torch.tensor(slots))
    assert _runs_of_each(tensors, max_runs) == [slot_runs(t, max_runs) for t in tensors]
