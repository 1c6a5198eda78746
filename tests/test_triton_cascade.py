"""Triton cascade (shared-prefix) attention vs the plain torch reference on the same metadata.

Batches are built from a tree of shared prefixes (tests/_cascade_batches.py): the members of a
SharedPrefix really hold the same slots for its positions (pages of each segment scattered over a
shuffled pool), every other position has slots of its own, and slots nobody owns hold NaN, so a
read outside a range fails loudly. Small blocks make short prefixes span several blocks, chunks
and query tiles.
"""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _cascade_batches
from _cascade_batches import shared_trees
from radixserve.kernels.attention import torch_ref
from radixserve.kernels.attention.triton_backend import TritonAttentionBackend
from radixserve.kernels.attention.triton_cascade import cascade_attention, prefix_work
from radixserve.kernels.attention.triton_store import kernels_interpreted

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DEVICE = "cuda" if torch.cuda.is_available() and not kernels_interpreted() else "cpu"


def make_shared_batch(own_cached, q_lens, groups, **kw):
    """The shared builder (tests/_cascade_batches.py) on this module's device."""
    return _cascade_batches.make_shared_batch(own_cached, q_lens, groups, device=DEVICE, **kw)


def _check(meta, k_cache, v_cache, q, dtype, window=None, **knobs):
    sm_scale = q.shape[2] ** -0.5
    out = cascade_attention(q, k_cache, v_cache, meta, sm_scale, window, **knobs)
    expected = torch_ref.extend_attention(q.float(), k_cache.float(), v_cache.float(), meta, sm_scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)
    return out


def _blocks(group):
    """Tiles of 16 rows (tokens x padded group) and 16 keys."""
    return dict(block_m=max(1, 16 // 2 ** math.ceil(math.log2(group))), block_n=16)


CASES = [
    # dtype, head_dim, group, num_kv_heads, own_cached, q_lens, groups
    # depth 1, page-unaligned prefix (21), a sequence that shares nothing
    (torch.float32, 64, 1, 2, [0, 4, 7, 5], [5, 1, 3, 4], [([0, 1, 2], 21)]),
    # depth 3 with a prefix of length 1 in the middle; prefill chunks and decodes mixed
    (torch.float16, 128, 4, 1, [2, 0, 3, 1], [1, 6, 1, 2], [([0, 1, 2, 3], 18), ([0, 1, 2], 1), ([0, 1], 9)]),
    # two trees side by side, members not adjacent in the batch; a prefix of length 1 alone
    (torch.float32, 128, 4, 2, [0, 3, 0, 2, 0], [3, 1, 1, 2, 17],
     [([0, 2], 1), ([1, 3, 4], 33), ([3, 4], 5)]),
    # decode-only batch: own part through the split-K decode kernel
    (torch.float32, 64, 4, 2, [0, 2, 30, 1], [1, 1, 1, 1], [([0, 1, 2, 3], 40), ([1, 2], 3)]),
    (torch.float16, 64, 1, 4, [5, 0, 0], [1, 1, 1], [([0, 1, 2], 16), ([1, 2], 17)]),  # page-aligned first
]


@pytest.mark.parametrize("kv_chunk", [None, 16])
@pytest.mark.parametrize("dtype,head_dim,group,num_kv_heads,own_cached,q_lens,groups", CASES)
def test_cascade_matches_reference(dtype, head_dim, group, num_kv_heads, own_cached, q_lens, groups, kv_chunk):
    meta, k_cache, v_cache, q = make_shared_batch(own_cached, q_lens, groups, group=group,
                                                  num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    knobs = _blocks(group) | dict(kv_chunk=kv_chunk)
    if meta.is_decode:
        knobs["num_kv_splits"] = 2
    _check(meta, k_cache, v_cache, q, dtype, **knobs)


def test_prefix_work_chunks_and_merge_csr():
    meta, *_ = make_shared_batch([0, 1, 0], [2, 1, 3], [([0, 1, 2], 40), ([0, 2], 5)], group=1,
                                 num_kv_heads=1, head_dim=16, dtype=torch.float32)
    work = prefix_work(meta, 1, 16, 16, 16, torch.device(DEVICE))
    assert work is prefix_work(meta, 1, 16, 16, 16, torch.device(DEVICE)), "built once per step"
    # 40 keys in chunks of 16: 3 items of 6 queries; 5 keys: one item of 5 queries.
    assert work.item_kv_len.tolist() == [16, 16, 8, 5] and work.item_q_len.tolist() == [6, 6, 6, 5]
    assert work.item_kv_start.tolist() == [0, 16, 32, 40] and work.item_q_start.tolist() == [0, 6, 12, 18]
    counts = work.merge_indptr.diff().tolist()
    assert counts == [4, 4, 3, 4, 4, 4]  # token 2 (seq 1) is below the first prefix only
    rows = work.entry_rows[work.merge_order]
    assert rows.tolist() == sorted(rows.tolist()) and bool((work.merge_order[:4].diff() > 0).all())


def test_backend_cascade_and_window_paths():
    meta, k_cache, v_cache, q = make_shared_batch([1, 0, 2], [3, 1, 4], [([0, 1, 2], 20), ([0, 2], 3)], group=2,
                                                  num_kv_heads=2, head_dim=64, dtype=torch.float32)
    backend = TritonAttentionBackend()
    assert backend.needs_kv_indices and backend.name == "triton"
    # The new tokens' K/V again: forward stores them itself (same values, same slots).
    k_new, v_new = k_cache[meta.out_slot_ids].clone(), v_cache[meta.out_slot_ids].clone()
    for window in (None, 5, 30):  # windows take the plain path over every position
        out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, 0.125, window)
        expected = torch_ref.extend_attention(q, k_cache, v_cache, meta, 0.125, window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert any(key[0] == "triton_cascade" for key in meta.step_cache)


@settings(max_examples=25, deadline=None)
@given(tree=shared_trees(), group=st.sampled_from([1, 4]), head_dim=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.float32, torch.float16]), kv_chunk=st.sampled_from([None, 16]),
       seed=st.integers(0, 2**16))
def test_cascade_random_trees(tree, group, head_dim, dtype, kv_chunk, seed):
    own_cached, q_lens, groups = tree
    meta, k_cache, v_cache, q = make_shared_batch(own_cached, q_lens, groups, group=group, num_kv_heads=2,
                                                  head_dim=head_dim, dtype=dtype, page_size=8, seed=seed)
    _check(meta, k_cache, v_cache, q, dtype, kv_chunk=kv_chunk, **_blocks(group))


COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from radixserve.kernels.attention import triton_cascade as tc, triton_decode as td, triton_extend as te

    I32 = {"item_q_start_ptr", "item_q_len_ptr", "item_kv_start_ptr", "item_kv_len_ptr", "indptr_ptr",
           "qo_indptr_ptr", "kv_indptr_ptr", "kv_lens_ptr", "own_start_ptr"}
    I64 = {"entry_rows_ptr", "slots_ptr", "order_ptr", "kv_indices_ptr"}
    F32 = {"lse_ptr", "own_out_ptr", "own_lse_ptr", "part_out_ptr", "part_lse_ptr", "mid_acc_ptr", "mid_max_ptr",
           "mid_sum_ptr"}
    def arg_type(name, dtype, kernel):
        if name in I32: return "*i32"
        if name in I64: return "*i64"
        if name in F32 or (name == "out_ptr" and kernel is tc._prefix_kernel): return "*fp32"
        if name.endswith("_ptr"): return "*" + dtype
        return "fp32" if name == "qk_scale" else "i32"
    p = te.DOT_PRECISION
    variants = [
        (tc._prefix_kernel, "bf16", dict(BLOCK_M=16, BLOCK_G=4, BLOCK_N=64, BLOCK_D=128, PRECISION=p)),
        (tc._prefix_kernel, "fp32", dict(BLOCK_M=32, BLOCK_G=1, BLOCK_N=32, BLOCK_D=128, PRECISION=p)),
        (tc._merge_kernel, "bf16", dict(BLOCK_H=16, BLOCK_D=128)),
        (te._extend_kernel, "bf16", dict(BLOCK_M=16, BLOCK_G=4, BLOCK_N=64, BLOCK_D=128, PRECISION=p,
                                         HAS_OWN_START=True, WRITE_LSE=True)),
        (td._decode_split_kernel, "bf16", dict(BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, PRECISION=p, DIRECT=True,
                                               HAS_OWN_START=True, WRITE_LSE=True)),
    ]
    for kernel, dtype, constexprs in variants:
        sig = {n: arg_type(n, dtype, kernel) for n in kernel.arg_names}
        sig.update({n: "constexpr" for n in constexprs})
        c = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 2})
        ok = c.metadata.shared <= 232448 and (dtype != "fp32" or "tf32" not in c.asm["ptx"])
        print("compiled" if ok else "BAD", kernel.__name__, dtype, c.metadata.shared)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels compiled already")
def test_cascade_kernels_compile_for_sm90():
    """GPU-only errors (tl.dot shapes, dtypes, shared memory, TF32) caught without a GPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("compiled ") for line in lines), proc.stdout
