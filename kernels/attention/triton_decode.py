"""Triton decode attention over the paged KV pool: split-K with a merge, GQA-aware.

One new token per sequence, so a sequence alone is too little work for the GPU. Stage 1
splits each sequence's visible KV range into ``num_kv_splits`` chunks (whole BLOCK_N
blocks) and runs one program per (sequence, kv head, split); the program handles all q
heads of that kv head's group at once, so each K/V block is read once per group:

    visible kv:   lo = max(0, kv_len - window, own_start) .............. kv_len
                  | split 0        | split 1        | split 2  | (empty) |
    stage 1 writes per (seq, q head, split): running max m, sum l, unnormalised acc
    stage 2 merges:  out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,  M = max_s m_s
    (with a single split, stage 1 normalises and writes the output itself; no stage 2)
    optional log-sum-exp per (seq, q head), natural log: lse = (M + log2(sum_s exp2(m_s - M) l_s)) ln 2

``own_start`` and the LSE are for cascade attention (``triton_cascade``); without them the
kernels are exactly the plain decode ones.

Same signature as ``torch_ref.decode_attention`` (plus keyword-only tuning knobs).
"""
from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from .base import AttentionMetadata
from .triton_extend import (DOT_PRECISION, LOG2_E, check_attention_inputs,
                                                         check_partial_outputs, natural_lse, window_arg)
from .triton_store import kernels_interpreted

logger = logging.getLogger(__name__)

MIN_TOKENS_PER_SPLIT = 256  # below this, a split's launch and merge cost more than they save
MAX_KV_SPLITS = 16
PROGRAMS_PER_SM = 4  # enough resident programs per SM to hide memory latency


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    *,
    num_kv_splits: int | None = None,
    block_n: int | None = None,
    own_start: torch.Tensor | None = None,  # [num_seqs] int32: keys at positions < own_start are skipped
    lse: torch.Tensor | None = None,  # [num_seqs, num_q_heads] fp32, filled with each row's natural-log LSE
    out: torch.Tensor | None = None,  # [num_seqs, num_q_heads, head_dim] any float dtype (default q's)
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Attention of each sequence's single new token over its whole KV (already stored), or over
    keys ``[own_start, kv_len)`` only when ``own_start`` is given."""
    num_seqs, num_q_heads, head_dim = q.shape
    group = check_attention_inputs(q, k_cache, v_cache)
    if num_seqs != meta.num_seqs:
        raise ValueError(f"decode_attention: q has {num_seqs} tokens but the batch has {meta.num_seqs} "
                         "sequences (decode needs exactly one new token per sequence)")
    num_kv_heads = k_cache.shape[1]
    out = check_partial_outputs(q, meta, own_start, lse, out)
    if num_seqs == 0:
        return out
    # fp32 tiles on a GPU are halved for shared memory; the interpreter prefers fewer loop steps.
    block_n = block_n or (32 if q.element_size() >= 4 and not kernels_interpreted() else 64)
    num_sms = _num_sms(q.device) if q.is_cuda else None
    num_kv_splits = num_kv_splits or default_num_kv_splits(meta.max_kv_len, num_seqs * num_kv_heads, num_sms)
    if block_n < 16 or num_kv_splits < 1:
        raise ValueError(f"decode_attention: block_n ({block_n}) must be >= 16 and num_kv_splits "
                         f"({num_kv_splits}) >= 1")
    block_d = max(16, triton.next_power_of_2(head_dim))
    # tl.dot needs >= 16 rows on the GPU, so small groups (MHA: 1) are padded and masked.
    block_h = max(16, triton.next_power_of_2(group))

    direct = num_kv_splits == 1  # one split: stage 1 normalises and writes out, no merge launch
    if direct:
        mid_acc = mid_max = mid_sum = out  # placeholders, never touched when DIRECT
    else:
        mid_acc = torch.empty((num_seqs, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32,
                              device=q.device)
        mid_max = torch.empty((num_seqs, num_q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
        mid_sum = torch.empty_like(mid_max)
    lse_arg = out if lse is None else lse  # placeholder pointer, never touched without WRITE_LSE
    stride_lse = 0 if lse is None else lse.stride(0)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, mid_acc, mid_max, mid_sum, out, lse_arg,
        meta.kv_indptr, meta.kv_indices, meta.kv_lens, meta.kv_lens if own_start is None else own_start,
        sm_scale * LOG2_E, window_arg(sliding_window), num_kv_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), stride_lse,
        group, num_q_heads, head_dim,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION=DOT_PRECISION,
        DIRECT=direct, HAS_OWN_START=own_start is not None, WRITE_LSE=lse is not None,
        num_warps=4, num_stages=2,
    )
    if direct:
        return out
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        mid_acc, mid_max, mid_sum, out, lse_arg,
        num_kv_splits, head_dim,
        out.stride(0), out.stride(1), stride_lse,
        BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=block_d, WRITE_LSE=lse is not None,
    )
    return out


def default_num_kv_splits(max_kv_len: int, num_programs: int = 1, num_sms: int | None = None) -> int:
    """Enough splits that a long context is spread over several programs, never tiny ones;
    on a GPU, no more than needed to give every SM a few programs (num_programs = seqs x kv heads)."""
    num_splits = min(MAX_KV_SPLITS, triton.cdiv(max_kv_len, MIN_TOKENS_PER_SPLIT))
    if num_sms is not None:
        num_splits = min(num_splits, triton.cdiv(PROGRAMS_PER_SM * num_sms, num_programs))
    return max(1, num_splits)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, mid_acc_ptr, mid_max_ptr, mid_sum_ptr, out_ptr, lse_ptr,
    kv_indptr_ptr, kv_indices_ptr, kv_lens_ptr, own_start_ptr,
    qk_scale, window, num_kv_splits,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_s, stride_k_h, stride_k_d,
    stride_v_s, stride_v_h, stride_v_d,
    stride_o_t, stride_o_h, stride_lse_t,
    group, num_q_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, DIRECT: tl.constexpr, HAS_OWN_START: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_idx = tl.program_id(2)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_valid = offs_h < group
    d_valid = offs_d < head_dim
    q_heads = kv_head * group + offs_h  # [BLOCK_H] q heads sharing this kv head
    q = tl.load(q_ptr + seq_idx.to(tl.int64) * stride_q_t + q_heads[:, None] * stride_q_h
                + offs_d[None, :] * stride_q_d,
                mask=h_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    kv_start = tl.load(kv_indptr_ptr + seq_idx).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + seq_idx)
    lo = 0
    if window > 0:
        lo = tl.maximum(kv_len - window, 0)
    if HAS_OWN_START:
        lo = tl.maximum(lo, tl.load(own_start_ptr + seq_idx))
    # Whole blocks per split keep every block but the last one full.
    split_len = (kv_len - lo + num_kv_splits - 1) // num_kv_splits
    split_len = (split_len + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    split_lo = lo + split_idx * split_len
    split_hi = tl.minimum(split_lo + split_len, kv_len)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: an empty split merges as weight 0
    l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
    for start_n in range(split_lo, split_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] kv positions
        n_valid = offs_n < split_hi
        slots = tl.load(kv_indices_ptr + kv_start + offs_n, mask=n_valid, other=0).to(tl.int64)
        k = tl.load(k_cache_ptr + slots[None, :] * stride_k_s + kv_head * stride_k_h + offs_d[:, None] * stride_k_d,
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        scores = tl.where(n_valid[None, :], qk * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_v_s + kv_head * stride_v_h + offs_d[None, :] * stride_v_d,
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq_idx.to(tl.int64) * stride_o_t + q_heads[:, None] * stride_o_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & d_valid[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + seq_idx.to(tl.int64) * stride_lse_t + q_heads, natural_lse(m_i, l_i), mask=h_valid)
    else:
        # mid_* are contiguous [num_seqs, num_q_heads, num_kv_splits(, head_dim)].
        row = (seq_idx.to(tl.int64) * num_q_heads + q_heads) * num_kv_splits + split_idx  # [BLOCK_H]
        tl.store(mid_max_ptr + row, m_i, mask=h_valid)
        tl.store(mid_sum_ptr + row, l_i, mask=h_valid)
        tl.store(mid_acc_ptr + row[:, None] * head_dim + offs_d[None, :], acc,
                 mask=h_valid[:, None] & d_valid[None, :])


@triton.jit
def _decode_merge_kernel(
    mid_acc_ptr, mid_max_ptr, mid_sum_ptr, out_ptr, lse_ptr,
    num_kv_splits, head_dim,
    stride_o_t, stride_o_h, stride_lse_t,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    head_idx = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < num_kv_splits
    d_valid = offs_d < head_dim

    base = (seq_idx.to(tl.int64) * num_q_heads + head_idx) * num_kv_splits
    m_s = tl.load(mid_max_ptr + base + offs_s, mask=s_valid, other=float("-inf"))  # [BLOCK_S]
    l_s = tl.load(mid_sum_ptr + base + offs_s, mask=s_valid, other=0.0)
    acc_s = tl.load(mid_acc_ptr + (base + offs_s)[:, None] * head_dim + offs_d[None, :],
                    mask=s_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    m_all = tl.max(m_s, 0)
    weight = tl.exp2(m_s - m_all)  # scores are in log2 units already
    total = tl.sum(weight * l_s, 0)
    out = tl.sum(weight[:, None] * acc_s, 0) / tl.where(total > 0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + seq_idx.to(tl.int64) * stride_o_t + head_idx * stride_o_h + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)
    if WRITE_LSE:  # log of 2^M x sum_s exp2(m_s - M) l_s, in natural units
        tl.store(lse_ptr + seq_idx.to(tl.int64) * stride_lse_t + head_idx, natural_lse(m_all, total))
