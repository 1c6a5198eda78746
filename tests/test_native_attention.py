"""The native CPU attention kernel (kernels/native.py, kernels/cpu_kernels.c) against float64 torch.

Rows see random key intervals (empty, one key, all, crossing the kernel's 64-row items, 16-row
strips and 128-key blocks); keys sit on random slots of a pool whose other slots hold NaN, so a
read outside a batch entry's keys shows in the output. The cascade and engine tests run it inside
the backend; here it is checked alone, shape by shape, on every build this CPU can run and every
element type and QK^T path of each (tests/_native_readers.py). The module skips only where nothing
can be built (not Linux, no C compiler): a build that fails fails the tests.

Tolerance: fp32 accumulation (ATOL), the same for fp32 and bf16 (bf16 inputs are exact in float64),
plus on AMX the rounding of P to bf16 (``_native_readers.p_rounding`` times sum_j p_j |v_j|).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _native_readers import NEEDS_NATIVE, isa, p_rounding, reader  # noqa: F401 (fixtures)
from radixserve.kernels import native

pytestmark = NEEDS_NATIVE
ATOL = 1e-5


def _reference(q, k_cache, v_cache, slots, lo, hi, scale):
    """q [b, h, r, d]; keys of entry b = slots[b]; row r sees [lo, hi). Empty rows: 0 and -inf.
    Returns out, lse and sum_j p_j |v_j| (what rounding P scales), in float64."""
    keys = k_cache[slots].permute(0, 2, 1, 3).double()  # [b, h, n, d]
    values = v_cache[slots].permute(0, 2, 1, 3).double()
    s = q.double() @ keys.transpose(-1, -2) * scale
    j = torch.arange(slots.shape[1])
    seen = (j >= lo[..., None]) & (j < hi[..., None])  # [b, r, n]
    s = s.masked_fill(~seen[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(seen[:, None], torch.softmax(s.nan_to_num(neginf=-1e300), -1), 0.0)
    return p @ values, lse, p @ values.abs()


def _assert_close(out, lse, expected, expected_lse, mass, dtype):
    """out / lse (float32) against the float64 reference within the reader's bound (module docstring)."""
    bound = ATOL + p_rounding(dtype) * mass
    assert ((out.double() - expected).abs() <= bound).all(), (out.double() - expected).abs().max()
    torch.testing.assert_close(lse, expected_lse.float(), atol=ATOL, rtol=0)  # -inf where a row sees nothing


def _nan_pool(gen, b, num_keys, kv_heads, d, dtype=torch.float32):
    """A pool of NaN where b entries' num_keys keys each sit on random slots: (k_cache, v_cache, slots [b, keys])."""
    pool = 2 * b * num_keys + 8
    k_cache = torch.full((pool, kv_heads, d), float("nan"), dtype=dtype)
    v_cache = torch.full((pool, kv_heads, d), float("nan"), dtype=dtype)
    slots = torch.randperm(pool, generator=gen)[:b * num_keys].view(b, num_keys)
    k_cache[slots] = torch.randn(b, num_keys, kv_heads, d, generator=gen).to(dtype)
    v_cache[slots] = torch.randn(b, num_keys, kv_heads, d, generator=gen).to(dtype)
    return k_cache, v_cache, slots


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), rows=st.one_of(st.integers(1, 20), st.integers(60, 140)),
       num_keys=st.one_of(st.integers(1, 12), st.integers(120, 300)), d=st.sampled_from([32, 64, 96, 128]),
       threads=st.sampled_from([1, 2]), data=st.data())
def test_matches_reference(reader, b, h, rows, num_keys, d, threads, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    k_cache, v_cache, slots = _nan_pool(gen, b, num_keys, h, d, reader)
    lo = torch.randint(0, num_keys + 1, (b, rows), generator=gen, dtype=torch.int32)
    hi = torch.randint(0, num_keys + 1, (b, rows), generator=gen, dtype=torch.int32)
    kind = data.draw(st.sampled_from(["random", "all", "causal"]), label="intervals")
    if kind == "all":
        lo.zero_(), hi.fill_(num_keys)
    elif kind == "causal":  # the last row sees every key, each earlier row one fewer
        lo.zero_()
        hi.copy_((num_keys - rows + 1 + torch.arange(rows)).clamp(0, num_keys).expand(b, rows))
    # q as a strided view (rows of a token-major tensor), as the backend passes stacked heads.
    q = torch.randn(b, rows, h, d, generator=gen).to(reader).transpose(1, 2)
    torch.set_num_threads(threads)
    try:
        out, lse = native.attend_paged(q, k_cache, v_cache, slots, (lo, hi), d ** -0.5)
    finally:
        torch.set_num_threads(1)
    _assert_close(out, lse, *_reference(q, k_cache, v_cache, slots, lo, hi, d ** -0.5), reader)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
       per_entry=st.one_of(st.integers(1, 4), st.integers(20, 50)),
       num_keys=st.one_of(st.integers(1, 9), st.integers(120, 200)),
       d=st.sampled_from([32, 64]), merge=st.booleans(), threads=st.sampled_from([1, 2]), data=st.data())
def test_rows_by_token_write_and_merge_in_place(reader, b, kv_heads, group, per_entry, num_keys, d, merge, threads,
                                                data):
    """attend_tokens: q and out are token-major [tokens, q_heads, d]; entry rows name their tokens
    (-1: padding, never written). merge=True folds the call's keys into the partial out / lse
    already hold, so prior keys + these keys = attention over both; untouched tokens keep their bytes."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    num_tokens, q_heads = b * per_entry + 5, kv_heads * group
    k_cache, v_cache, slots = _nan_pool(gen, b, num_keys, kv_heads, d, reader)
    tokens = torch.randperm(num_tokens, generator=gen)[:b * per_entry].view(b, per_entry).to(torch.int32)
    tokens[torch.rand(b, per_entry, generator=gen) < 0.2] = -1  # padding rows
    rows = per_entry * group
    lo = torch.randint(0, num_keys + 1, (b, rows), generator=gen, dtype=torch.int32)
    hi = torch.randint(0, num_keys + 1, (b, rows), generator=gen, dtype=torch.int32)
    q = torch.randn(num_tokens, q_heads + 1, d, generator=gen).to(reader)[:, 1:]  # a strided view, as after a split
    # The partial already held: each token's attention over 30 prior keys of its own (or nothing, lse -inf).
    prior_k = torch.randn(num_tokens, kv_heads, 30, d, generator=gen)
    prior_v = torch.randn(num_tokens, kv_heads, 30, d, generator=gen)
    heads = torch.arange(q_heads) // group
    ps = torch.einsum("thd,thkd->thk", q.double(), prior_k[:, heads].double()) * d ** -0.5
    no_prior = torch.rand(num_tokens, generator=gen) < 0.2
    ps[no_prior] = float("-inf")
    out = torch.einsum("thk,thkd->thd", torch.softmax(ps, -1).nan_to_num(0.0), prior_v[:, heads].double()).float()
    lse = torch.logsumexp(ps, -1).float()
    before_out, before_lse = out.clone(), lse.clone()
    torch.set_num_threads(threads)
    try:
        native.attend_tokens(q, k_cache, v_cache, slots, (lo, hi), tokens, d ** -0.5, out, lse, merge=merge)
    finally:
        torch.set_num_threads(1)
    # Reference per written (token, q head): scores over the call's keys, plus the prior's when merging.
    expected_out, expected_lse = before_out.double(), before_lse.double()
    mass = torch.zeros_like(expected_out)  # sum_j p_j |v_j| of each written row
    for e in range(b):
        for r in range(rows):
            t, head = int(tokens[e, r // group]), (r % group)
            if t < 0:
                continue
            for h in range(kv_heads):
                qh = h * group + head
                keys = slots[e, lo[e, r]:max(lo[e, r], hi[e, r])]
                s = (k_cache[keys, h].double() @ q[t, qh].double()) * d ** -0.5
                vals = v_cache[keys, h].double()
                if merge:
                    s = torch.cat([s, ps[t, qh]])
                    vals = torch.cat([vals, prior_v[t, h].double()])
                if s.numel() == 0 or bool(torch.isinf(s).all()):
                    if not merge:
                        expected_out[t, qh], expected_lse[t, qh] = 0.0, float("-inf")
                    continue
                expected_out[t, qh] = torch.softmax(s, 0) @ vals
                expected_lse[t, qh] = torch.logsumexp(s, 0)
                mass[t, qh] = torch.softmax(s, 0) @ vals.abs()
    _assert_close(out, lse, expected_out, expected_lse, mass, reader)


def test_contiguous_keys_without_slots_or_bounds(reader):
    """slots None: key j is slot j of the (view of the) pool; bounds None: every row sees every key."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(400, 2, 64, generator=gen).to(reader) for _ in range(2))
    q = torch.randn(1, 2, 70, 64, generator=gen).to(reader)
    out, lse = native.attend_paged(q, k_cache[100:300], v_cache[100:300], None, None, 0.125)
    slots = torch.arange(100, 300)[None]
    full = (torch.zeros(1, 70, dtype=torch.int32), torch.full((1, 70), 200, dtype=torch.int32))
    _assert_close(out, lse, *_reference(q, k_cache, v_cache, slots, *full, 0.125), reader)


@pytest.mark.parametrize("rows", [5, 20])  # the few-row path and the tiles
def test_reference_catches_a_one_key_shift(reader, rows):
    """The comparison fails when a row reads one key past its interval."""
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(64, 1, 32, generator=gen).to(reader) for _ in range(2))
    slots = torch.arange(64)[None]
    q = torch.randn(1, 1, rows, 32, generator=gen).to(reader)
    lo = torch.zeros(1, rows, dtype=torch.int32)
    hi = torch.full((1, rows), 40, dtype=torch.int32)
    out, lse = native.attend_paged(q, k_cache, v_cache, slots, (lo, hi + 1), 0.2)
    with pytest.raises(AssertionError):
        _assert_close(out, lse, *_reference(q, k_cache, v_cache, slots, lo, hi, 0.2), reader)


def test_supports_only_what_it_computes():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert native.supports(dtype, 64, cpu) and native.supports(dtype, 128, cpu)
        assert not native.supports(dtype, 48, cpu)  # not a multiple of 32
        assert not native.supports(dtype, 256, cpu)  # above MAX_HEAD_DIM
    assert not native.supports(torch.float16, 64, cpu)
    with pytest.raises(ValueError, match="head_dim 48"):
        native.attend_paged(torch.zeros(1, 1, 1, 48), torch.zeros(4, 1, 48), torch.zeros(4, 1, 48), None, None, 1.0)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):  # q in another dtype than the pool
        native.attend_paged(torch.zeros(1, 1, 1, 64), torch.zeros(4, 1, 64, dtype=torch.bfloat16),
                            torch.zeros(4, 1, 64, dtype=torch.bfloat16), None, None, 1.0)


def test_supports_nothing_where_it_cannot_build(monkeypatch, tmp_path, caplog):
    """No compiler: load() says why once, as a WARNING with its cost, and returns None; supports() is
    then False everywhere, and status() says why."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))  # nothing built there yet
    native.reset()
    try:
        with caplog.at_level("INFO", logger="radixserve.kernels.native"):
            assert native.load() is None
            assert not native.supports(torch.float32, 64, torch.device("cpu"))
        assert native.status() == f"unavailable: no C compiler ({tmp_path / 'no-such-cc'}) on PATH"
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "flash op, ~1.5-2.5x slower" in warnings[0].getMessage()
    finally:
        native.reset()
    monkeypatch.undo()
    assert native.load() is not None


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 300), threads=st.sampled_from([1, 2]), data=st.data())
def test_argmax_rows_equals_torch_argmax(isa, rows, cols, threads, data):
    """Ties (the first max), NaN (the first NaN), -inf rows, tails shorter than a vector, strided rows."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    x = torch.randint(-3, 4, (rows, cols + 3), generator=gen).float()[:, 2:cols + 2]  # few values: many ties
    specials = data.draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, cols - 1),
                                            st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30])),
                                  max_size=6), label="specials")
    for r, c, value in specials:
        x[r, c] = value
    if data.draw(st.booleans(), label="an all -inf row"):
        x[0] = float("-inf")
    torch.set_num_threads(threads)
    try:
        got = native.argmax_rows(x)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(got, x.argmax(dim=-1))
