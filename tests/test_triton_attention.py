"""Triton attention kernels vs the torch reference (CPU: Triton interpreter, set in conftest).

Pools are paged with shuffled pages and unowned slots hold NaN, so a kernel that reads
outside a sequence's KV, or a mask that lets a wrong position through, fails loudly.
Small block sizes make short contexts span several blocks, pages and KV splits.
"""
import os
import subprocess
import sys

import pytest
import torch

from radixserve.bench.device_check import make_meta, make_paged_batch
from radixserve.kernels.attention import torch_ref
from radixserve.kernels.attention.torch_ref import TorchAttentionBackend
from radixserve.kernels.attention.triton_backend import TritonAttentionBackend
from radixserve.kernels.attention.triton_decode import MAX_KV_SPLITS, decode_attention, default_num_kv_splits
from radixserve.kernels.attention.triton_extend import extend_attention
from radixserve.kernels.attention.triton_store import kernels_interpreted, store_kv

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() and not kernels_interpreted() else "cpu"


def _batch(prefix_lens, q_lens, *, group, num_kv_heads, head_dim, page_size, dtype, seed=0, device=DEVICE):
    batch = make_paged_batch(prefix_lens, q_lens, page_size=page_size, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, device=device, seed=seed)
    torch_ref.store_kv(batch.k_cache, batch.v_cache, batch.k_new, batch.v_new, batch.meta.out_slot_ids)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((sum(q_lens), num_kv_heads * group, head_dim), generator=gen)  # [num_tokens, q_heads, d]
    return batch, q.to(device=device, dtype=dtype)


def _expected(fn, q, batch, sm_scale, window):
    """The reference on fp32 copies: low-precision kernels are judged against exact math."""
    return fn(q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.meta, sm_scale, window)


def _assert_close(out, expected, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=0)


def test_paged_layout_is_scattered():
    batch = make_paged_batch([40, 20], [9, 1], page_size=16, num_kv_heads=1, head_dim=16,
                             dtype=torch.float32, seed=3)
    first = batch.slot_lists[0]
    assert len(first) == 49 and len(set(first)) == 49
    assert any(b - a != 1 for a, b in zip(first, first[1:])), "pages should not be contiguous"
    assert set(first).isdisjoint(batch.slot_lists[1])


@pytest.mark.parametrize("dtype,block_t", [(torch.float32, None), (torch.float16, 1), (torch.float32, 8)])
def test_store_kv_matches_reference(dtype, block_t):
    batch = make_paged_batch([5, 0, 18], [3, 17, 1], page_size=16, num_kv_heads=2, head_dim=64,
                             dtype=dtype, device=DEVICE)
    # k/v as strided views of one fused projection, as a model's qkv split produces them.
    fused = torch.randn((21, 2, 3, 64)).to(device=DEVICE, dtype=torch.float32)  # [tokens, kv_h, 3, d]
    k, v = fused[:, :, 1], fused[:, :, 2]
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    torch_ref.store_kv(ref_k, ref_v, k, v, batch.meta.out_slot_ids)
    store_kv(batch.k_cache, batch.v_cache, k, v, batch.meta.out_slot_ids, block_t=block_t)
    assert torch.equal(batch.k_cache.nan_to_num(-7.0), ref_k.nan_to_num(-7.0))
    assert torch.equal(batch.v_cache.nan_to_num(-7.0), ref_v.nan_to_num(-7.0))
    assert torch.isnan(batch.k_cache).any(), "slots nobody owns must stay untouched"


EXTEND_CASES = [
    # dtype, head_dim, group, num_kv_heads, page_size, window, prefix_lens, q_lens
    (torch.float32, 64, 1, 2, 1, None, [0, 7, 33], [5, 20, 1]),  # ragged, empty prefix, a decode row
    (torch.float32, 128, 4, 1, 16, None, [21, 0, 50], [19, 40, 2]),  # prefixes not page-aligned
    (torch.float16, 64, 8, 1, 16, 24, [0, 45], [37, 3]),  # window reaching into the prefix
    (torch.float32, 64, 4, 2, 1, 7, [3, 0], [20, 17]),  # window shorter than a block
    (torch.float16, 128, 1, 2, 16, None, [16, 0], [16, 33]),  # page-aligned prefix
    (torch.float32, 64, 7, 2, 16, None, [9, 0], [12, 5]),  # group 7 (Qwen2-0.5B's 14 / 2): padded rows
]


@pytest.mark.parametrize("dtype,head_dim,group,num_kv_heads,page_size,window,prefix_lens,q_lens", EXTEND_CASES)
def test_extend_matches_reference(dtype, head_dim, group, num_kv_heads, page_size, window, prefix_lens, q_lens):
    batch, q = _batch(prefix_lens, q_lens, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      page_size=page_size, dtype=dtype)
    sm_scale = head_dim ** -0.5
    out = extend_attention(q, batch.k_cache, batch.v_cache, batch.meta, sm_scale, window, block_m=16, block_n=16)
    _assert_close(out, _expected(torch_ref.extend_attention, q, batch, sm_scale, window), dtype)


DECODE_CASES = [
    # dtype, head_dim, group, num_kv_heads, page_size, window, num_kv_splits, prefix_lens
    # Contexts up to 131 > block_n (16) x splits, crossing pages; kv_len 1 leaves splits empty.
    (torch.float32, 64, 1, 2, 16, None, 3, [0, 17, 130, 75, 47]),
    (torch.float32, 128, 4, 1, 1, None, 4, [99, 0, 64]),
    (torch.float16, 64, 8, 1, 16, None, 3, [130, 2, 31]),
    (torch.float32, 64, 4, 2, 16, 40, 3, [130, 10, 39]),  # window: only the last 40 positions
    (torch.float16, 128, 4, 1, 16, 5, 2, [60, 0]),
    (torch.float32, 64, 4, 2, 16, None, 1, [70, 0, 33]),  # one split: stage 1 writes the output
    (torch.float32, 64, 7, 2, 16, None, 2, [40, 3]),  # group 7: padded head rows
]


@pytest.mark.parametrize("dtype,head_dim,group,num_kv_heads,page_size,window,num_kv_splits,prefix_lens",
                         DECODE_CASES)
def test_decode_matches_reference(dtype, head_dim, group, num_kv_heads, page_size, window, num_kv_splits,
                                  prefix_lens):
    batch, q = _batch(prefix_lens, [1] * len(prefix_lens), group=group, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, page_size=page_size, dtype=dtype)
    sm_scale = head_dim ** -0.5
    out = decode_attention(q, batch.k_cache, batch.v_cache, batch.meta, sm_scale, window,
                           num_kv_splits=num_kv_splits, block_n=16)
    _assert_close(out, _expected(torch_ref.decode_attention, q, batch, sm_scale, window), dtype)


def _partial_reference(q, k_cache, v_cache, meta, own_start, sm_scale, window):
    """Per (token, q head): softmax over keys [max(own_start, pos - window + 1), pos] and its
    natural-log LSE, in fp32 from the keys in range only (so NaN outside them never enters)."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    qo, kvp, indices = meta.qo_indptr.tolist(), meta.kv_indptr.tolist(), meta.kv_indices.cpu()
    for i, (q_len, kv_len) in enumerate(zip(meta.q_lens_list, meta.kv_lens_list)):
        for j in range(q_len):
            pos, t = kv_len - q_len + j, qo[i] + j
            lo = max(own_start[i], pos - window + 1 if window else 0)
            slots = indices[kvp[i] + lo:kvp[i] + pos + 1]
            keys = k_cache.cpu()[slots].float().repeat_interleave(group, 1)  # [n, q_heads, d]
            values = v_cache.cpu()[slots].float().repeat_interleave(group, 1)
            scores = torch.einsum("hd,nhd->hn", q[t].cpu().float(), keys) * sm_scale
            lse[t] = torch.logsumexp(scores, -1)
            out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out.to(q.device), lse.to(q.device)


def _poison_below(batch, own_start):
    """NaN in the K/V of every position below own_start: a kernel that reads one fails loudly."""
    for slots, own in zip(batch.slot_lists, own_start):
        batch.k_cache[slots[:own]] = float("nan")
        batch.v_cache[slots[:own]] = float("nan")


PARTIAL_CASES = [
    # kind, dtype, head_dim, group, num_kv_heads, window, splits, prefix_lens, q_lens, own_start
    ("extend", torch.float32, 64, 4, 2, None, None, [10, 0, 33], [5, 7, 1], [4, 0, 30]),
    ("extend", torch.float16, 128, 1, 2, 6, None, [20, 3], [9, 18], [17, 1]),  # window above / below own_start
    ("decode", torch.float32, 64, 4, 2, None, 3, [40, 17, 130], [1, 1, 1], [20, 0, 100]),
    ("decode", torch.float16, 128, 1, 2, 50, 1, [90, 7], [1, 1], [30, 7]),  # one split: direct LSE
]


@pytest.mark.parametrize("kind,dtype,head_dim,group,num_kv_heads,window,splits,prefix_lens,q_lens,own_start",
                         PARTIAL_CASES)
def test_own_start_and_lse_match_torch(kind, dtype, head_dim, group, num_kv_heads, window, splits, prefix_lens,
                                       q_lens, own_start):
    batch, q = _batch(prefix_lens, q_lens, group=group, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      page_size=16, dtype=dtype)
    _poison_below(batch, own_start)
    sm_scale = head_dim ** -0.5
    own = torch.tensor(own_start, dtype=torch.int32, device=DEVICE)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=DEVICE)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)  # fp32 partials, as cascade asks
    if kind == "extend":
        extend_attention(q, batch.k_cache, batch.v_cache, batch.meta, sm_scale, window, block_m=16, block_n=16,
                         own_start=own, lse=lse, out=out)
    else:
        decode_attention(q, batch.k_cache, batch.v_cache, batch.meta, sm_scale, window, num_kv_splits=splits,
                         block_n=16, own_start=own, lse=lse, out=out)
    ref_out, ref_lse = _partial_reference(q, batch.k_cache, batch.v_cache, batch.meta, own_start, sm_scale, window)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, ref_out, atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_zero_own_start_without_lse_is_the_plain_kernel(kind):
    prefix_lens = [30, 0, 70]
    q_lens = [4, 9, 1] if kind == "extend" else [1, 1, 1]
    batch, q = _batch(prefix_lens, q_lens, group=4, num_kv_heads=2, head_dim=64, page_size=16,
                      dtype=torch.float32)
    fn = extend_attention if kind == "extend" else decode_attention
    knobs = dict(block_n=16) | (dict(block_m=4) if kind == "extend" else dict(num_kv_splits=2))
    plain = fn(q, batch.k_cache, batch.v_cache, batch.meta, 0.125, **knobs)
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)
    assert torch.equal(fn(q, batch.k_cache, batch.v_cache, batch.meta, 0.125, own_start=zeros, **knobs), plain)
    assert torch.equal(fn(q, batch.k_cache, batch.v_cache, batch.meta, 0.125, own_start=zeros, lse=lse, **knobs),
                       plain)
    with pytest.raises(ValueError, match="lse"):
        fn(q, batch.k_cache, batch.v_cache, batch.meta, 0.125, lse=lse.double(), **knobs)


def test_decode_default_splits_and_blocks():
    # kv_len 601 with the defaults: 3 splits of whole blocks, the last one partial.
    batch, q = _batch([600, 3], [1, 1], group=4, num_kv_heads=1, head_dim=64, page_size=16,
                      dtype=torch.float32)
    out = decode_attention(q, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    _assert_close(out, _expected(torch_ref.decode_attention, q, batch, 0.125, None), torch.float32)


def test_default_num_kv_splits():
    assert default_num_kv_splits(1) == 1 and default_num_kv_splits(300) == 2
    assert default_num_kv_splits(10**6) == MAX_KV_SPLITS
    # On a GPU, a batch that already fills the SMs is not split further.
    assert default_num_kv_splits(8192, num_programs=8, num_sms=132) == MAX_KV_SPLITS
    assert default_num_kv_splits(8192, num_programs=4096, num_sms=132) == 1


def test_backend_matches_torch_backend_over_steps():
    """Prefill chunks, a mixed step and decodes through both backends; outputs and pools agree."""
    num_kv_heads, head_dim, group = 2, 64, 2
    gen = torch.Generator().manual_seed(7)
    # Step plans: (prefix_lens, q_lens) per sequence; slots come from one scattered layout.
    steps = [([0, 0], [12, 20]), ([12, 20], [9, 1]), ([21, 21], [1, 1]), ([22, 22], [1, 1])]
    layout = make_paged_batch([0, 0], [23, 23], page_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              dtype=torch.float32, device=DEVICE, seed=5)
    pools = {name: (layout.k_cache.clone(), layout.v_cache.clone()) for name in ("torch", "triton")}
    backends = {"torch": TorchAttentionBackend(), "triton": TritonAttentionBackend()}
    assert backends["triton"].name == "triton" and backends["triton"].needs_kv_indices
    for prefix_lens, q_lens in steps:
        kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
        meta = make_meta(prefix_lens, q_lens, [s[:n] for s, n in zip(layout.slot_lists, kv_lens)], DEVICE)
        num_tokens = sum(q_lens)
        q, k, v = (torch.randn((num_tokens, heads, head_dim), generator=gen).to(DEVICE)
                   for heads in (num_kv_heads * group, num_kv_heads, num_kv_heads))
        outs = {name: backend.forward(q, k, v, *pools[name], meta, 0.125, None)
                for name, backend in backends.items()}
        torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=0)
    for ref_cache, cache in zip(pools["torch"], pools["triton"]):
        assert torch.equal(ref_cache.nan_to_num(), cache.nan_to_num())


def test_rejects_mismatched_inputs():
    batch, q = _batch([4], [1], group=2, num_kv_heads=1, head_dim=16, page_size=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q.half(), batch.k_cache, batch.v_cache, batch.meta, 0.25)
    if kernels_interpreted():
        with pytest.raises(ValueError, match="bfloat16"):
            extend_attention(q.bfloat16(), batch.k_cache.bfloat16(), batch.v_cache.bfloat16(), batch.meta, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        extend_attention(q[:, :1].expand(-1, 3, -1), batch.k_cache.expand(-1, 2, -1),
                         batch.v_cache.expand(-1, 2, -1), batch.meta, 0.25)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_cpu_without_interpreter_gives_clear_error():
    code = ("import torch\n"
            "from radixserve.kernels.attention.triton_backend import TritonAttentionBackend\n"
            "x = torch.zeros(1, 1, 16)\n"
            "try:\n"
            "    TritonAttentionBackend().forward(x, x, x, x, x, None, 1.0, None)\n"
            "except ValueError as e:\n"
            "    print('ERR', e)\n")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout
