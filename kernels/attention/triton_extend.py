"""Triton extend (prefill) attention over the paged KV pool.

Each sequence's K/V (cached prefix + this step's new tokens, already stored by
``store_kv``) is gathered through ``kv_indices``. One program handles BLOCK_M new tokens of
one sequence for one kv head and *all* q heads of its GQA group (rows = token x head, so a
K/V block is loaded once per group), walking the KV blocks it may see with an online softmax:

    kv position:  0 ........ prefix_len ........................ kv_len
                  |  cached prefix  |   new tokens of this step    |
    query row j sits at pos = prefix_len + j and sees kv [max(own_start, pos - window + 1), pos]
    (no window, no own_start: [0, pos]); the block's kv loop runs over [lo, hi) only:
      lo = first kv any row of the block may see, hi = last row's pos + 1.

Cascade attention (``triton_cascade``) passes ``own_start`` (keys below it are read by the
shared-prefix kernel instead) and asks for the log-sum-exp of each (token, q head) row, so the
partial results can be merged. Without them the kernel is exactly the plain causal one.

Same signature as ``torch_ref.extend_attention`` (plus keyword-only tuning knobs and options).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .base import AttentionMetadata
from .triton_store import kernels_interpreted

logger = logging.getLogger(__name__)

LOG2_E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is the cheap instruction
# fp32 tl.dot must not silently run in TF32 on a GPU (ignored for fp16/bf16 and by the interpreter).
DOT_PRECISION = "ieee"


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    own_start: torch.Tensor | None = None,  # [num_seqs] int32: keys at positions < own_start are skipped
    lse: torch.Tensor | None = None,  # [num_tokens, num_q_heads] fp32, filled with each row's natural-log LSE
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim] any float dtype (default q's)
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole KV (prefix + new), or over
    keys ``[own_start, kv_len)`` only when ``own_start`` is given."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = check_attention_inputs(q, k_cache, v_cache)
    out = check_partial_outputs(q, meta, own_start, lse, out)
    if num_tokens == 0:
        return out
    block_g = triton.next_power_of_2(group)
    default_rows, default_n = _default_blocks(q)
    # tl.dot wants >= 16 rows on a GPU: rows per program = block_m tokens x block_g heads.
    block_m = block_m or max(1, default_rows // block_g)
    block_n = block_n or default_n
    if block_m * block_g < 16 or block_n < 16:
        raise ValueError(f"extend_attention: block_m x group ({block_m} x {block_g}) and block_n ({block_n}) "
                         "must be >= 16")
    grid = (meta.num_seqs, num_kv_heads, triton.cdiv(meta.max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, out if lse is None else lse,  # placeholder pointers are never touched
        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_lens,
        meta.kv_lens if own_start is None else own_start,
        sm_scale * LOG2_E, window_arg(sliding_window),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0),
        group, head_dim,
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION=DOT_PRECISION, HAS_OWN_START=own_start is not None, WRITE_LSE=lse is not None,
        num_warps=4, num_stages=2,
    )
    return out


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Validate shapes/dtypes shared by the Triton attention kernels; returns the GQA group size."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"attention: expected q [tokens, heads, dim] and caches [slots, kv_heads, dim], "
                         f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"attention: q {tuple(q.shape)} does not fit the pool {tuple(k_cache.shape)} "
                         "(head_dim must match, num_q_heads must be a multiple of num_kv_heads)")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"attention: q ({q.dtype}) and the KV pool ({k_cache.dtype}, {v_cache.dtype}) "
                         "must share one dtype")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("attention: the KV pool's head_dim must be contiguous (stride 1)")
    if q.dtype == torch.bfloat16 and kernels_interpreted():
        # The interpreter multiplies bf16 tiles as raw 16-bit integers (garbage); a GPU is fine.
        raise ValueError("attention: the Triton interpreter cannot run bfloat16 dots; use float32 or "
                         "float16 on the CPU (or attention_backend='torch')")
    return num_q_heads // num_kv_heads


def check_partial_outputs(q: torch.Tensor, meta: AttentionMetadata, own_start: torch.Tensor | None,
                          lse: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """Validate the cascade options of the extend/decode kernels; returns the output buffer."""
    num_tokens, num_q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or not out.is_floating_point() or out.stride(2) != 1:
        raise ValueError(f"attention: out {tuple(out.shape)} must be a float tensor shaped like q "
                         f"{tuple(q.shape)} with a contiguous head_dim")
    if lse is not None and (lse.shape != (num_tokens, num_q_heads) or lse.dtype != torch.float32
                            or lse.stride(1) != 1):
        raise ValueError(f"attention: lse must be float32 [{num_tokens}, {num_q_heads}] with contiguous heads, "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    if own_start is not None and (own_start.shape != (meta.num_seqs,) or own_start.dtype != torch.int32):
        raise ValueError(f"attention: own_start must be int32 [{meta.num_seqs}], got {own_start.dtype} "
                         f"{tuple(own_start.shape)}")
    return out


def window_arg(sliding_window: int | None) -> int:
    """Kernels take the window as an int; 0 means no window (as None or <= 0 does in torch_ref)."""
    return sliding_window if sliding_window is not None and sliding_window > 0 else 0


def _default_blocks(q: torch.Tensor) -> tuple[int, int]:
    """(q rows, kv block) per program."""
    if q.element_size() >= 4 and not kernels_interpreted():
        return 32, 32  # fp32 tiles take twice the shared memory; halve them so head_dim 128 fits
    return 64, 64


@triton.jit
def natural_lse(m, l):
    """Natural-log LSE of a running max ``m`` and sum ``l`` kept in log2 units (scores x log2(e));
    a row that saw no key (l == 0) gets -inf, i.e. weight 0 in a merge."""
    return tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, float("-inf"))


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    qo_indptr_ptr, kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr, own_start_ptr,
    qk_scale, window,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_s, stride_k_h, stride_k_d,
    stride_v_s, stride_v_h, stride_v_d,
    stride_o_t, stride_o_h,
    stride_lse_t,
    group, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, HAS_OWN_START: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)

    q_start = tl.load(qo_indptr_ptr + seq_idx)
    q_len = tl.load(qo_indptr_ptr + seq_idx + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # the grid is sized for the longest sequence
    kv_start = tl.load(kv_indptr_ptr + seq_idx).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq_idx)
    prefix_len = kv_len - q_len

    # Row r of the tile is (token m_block * BLOCK_M + r // BLOCK_G, q head kv_head * group + r % BLOCK_G).
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    offs_m = m_block * BLOCK_M + offs_r // BLOCK_G  # [rows] token within this seq's new tokens
    offs_g = offs_r % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    r_valid = (offs_m < q_len) & (offs_g < group)
    d_valid = offs_d < head_dim
    q_pos = prefix_len + offs_m  # [rows] absolute positions
    q_rows = (q_start + offs_m).to(tl.int64)
    q_heads = kv_head * group + offs_g
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + q_heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=r_valid[:, None] & d_valid[None, :], other=0.0)  # [rows, BLOCK_D]

    hi = tl.minimum(kv_len, prefix_len + (m_block + 1) * BLOCK_M)
    lo = 0
    if window > 0:
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
    if HAS_OWN_START:  # the same bound for every row: starting the loop there is the whole mask
        lo = tl.maximum(lo, tl.load(own_start_ptr + seq_idx))

    # Finite start so a row that sees nothing in a block keeps alpha = 1, p = 0 (no NaN).
    m_i = tl.full([BLOCK_M * BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] kv positions
        n_valid = offs_n < hi
        slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(k_cache_ptr + slots[None, :] * stride_k_s + kv_head * stride_k_h + offs_d[:, None] * stride_k_d,
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=PRECISION)  # [rows, BLOCK_N] fp32
        seen = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        seen = seen & ((window <= 0) | (offs_n[None, :] > q_pos[:, None] - window))
        scores = tl.where(seen, qk * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])  # [rows, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_v_s + kv_head * stride_v_h + offs_d[None, :] * stride_v_d,
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_o_t + q_heads[:, None] * stride_o_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_valid[:, None] & d_valid[None, :])
    if WRITE_LSE:
        tl.store(lse_ptr + q_rows * stride_lse_t + q_heads, natural_lse(m_i, l_i), mask=r_valid)
