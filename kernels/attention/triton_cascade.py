"""Triton cascade (shared-prefix) attention: own part + shared prefixes, merged by log-sum-exp.

For every shared prefix of ``meta.shared`` (key positions held in the same slots by all its
member sequences), the prefix kernel reads its K/V once per tile of queries *of all members*
instead of once per sequence. Each sequence's remaining keys ``[own_start, kv_len)`` go through
the extend or decode kernel with ``own_start`` set. Every partial result carries its natural-log
LSE; the merge kernel combines a row's partials:

    own part   (extend/decode, causal, keys [own_start, kv_len))  -> out_0, lse_0 per (token, head)
    prefix kernel, one launch for all "items" (shared prefix x chunk of its keys), no mask:
        item i: queries q[entry_rows[q_start_i : q_start_i + q_len_i]] over slots[kv_start_i : + kv_len_i]
        -> partial rows part_out[q_start_i + j], part_lse[q_start_i + j]
    merge:  out = sum_k exp(lse_k - M) out_k / sum_k exp(lse_k - M),  M = max_k lse_k
            (a token's partials: its own part, then its entries in item order, via a CSR)

A long prefix is split into chunks of whole BLOCK_N blocks (more programs when few queries
share it, as split-K does for decode); the merge handles the chunks like any other partial.
The item tables and the merge CSR are built once per step (device ops on the plans' tensors,
host ints only; no sync) and cached in ``meta.step_cache`` for every layer.

Sliding-window layers take the plain path (``kv_indices`` still holds every position): a
window can cut into a shared range, so the prefix kernel never needs a mask.

Same signature as ``torch_ref.extend_attention`` (plus keyword-only tuning knobs).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import AttentionMetadata
from .triton_decode import (MAX_KV_SPLITS, MIN_TOKENS_PER_SPLIT, PROGRAMS_PER_SM,
                                                        _num_sms, decode_attention, default_num_kv_splits)
from .triton_extend import (DOT_PRECISION, LOG2_E, _default_blocks,
                                                        check_attention_inputs, extend_attention, natural_lse,
                                                        window_arg)

logger = logging.getLogger(__name__)


@dataclass
class PrefixWork:
    """One step's shared-prefix work, as flat device tables (built once, reused by every layer)."""

    item_q_start: torch.Tensor  # [num_items] int32, first entry (and partial row) of each item
    item_q_len: torch.Tensor  # [num_items] int32
    item_kv_start: torch.Tensor  # [num_items] int32, first slot of each item's key chunk in `slots`
    item_kv_len: torch.Tensor  # [num_items] int32
    entry_rows: torch.Tensor  # [num_entries] int64, token row of q of each partial row
    slots: torch.Tensor  # [sum of prefix lengths] int64, every shared prefix's slots, concatenated
    merge_order: torch.Tensor  # [num_entries] int64, partial rows sorted by token (stable: item order)
    merge_indptr: torch.Tensor  # [num_tokens + 1] int32, token t's partials: merge_order[indptr[t]:indptr[t+1]]
    num_items: int
    num_entries: int
    max_q_len: int  # most queries of one item


def cascade_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    kv_chunk: int | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole KV, equal to
    ``torch_ref.extend_attention``, reading each shared prefix of ``meta.shared`` once per query
    tile. No shared prefixes, or a sliding window: the plain extend / decode kernels."""
    own_kernel = decode_attention if meta.is_decode else extend_attention
    own_knobs = dict(num_kv_splits=num_kv_splits, block_n=block_n) if meta.is_decode else dict(
        block_m=block_m, block_n=block_n)
    if not meta.shared or window_arg(sliding_window) > 0:
        return own_kernel(q, k_cache, v_cache, meta, sm_scale, sliding_window, **own_knobs)
    if meta.own_start is None:
        raise ValueError("cascade_attention: meta.shared is set but meta.own_start is not (build the "
                         "metadata with kernels.attention.metadata.build_metadata)")
    check_attention_inputs(q, k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if meta.is_decode and num_kv_splits is None:  # split the own range, usually far shorter than kv_len
        own_len = max(n - o for n, o in zip(meta.kv_lens_list, meta.own_starts()))
        own_knobs["num_kv_splits"] = default_num_kv_splits(own_len, meta.num_seqs * num_kv_heads,
                                                           _num_sms(q.device) if q.is_cuda else None)
    own_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    own_lse = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    own_kernel(q, k_cache, v_cache, meta, sm_scale, None, own_start=meta.own_start, lse=own_lse,
               out=own_out, **own_knobs)
    block_m, block_n = prefix_blocks(q, num_kv_heads, block_m, block_n)
    work = prefix_work(meta, num_kv_heads, block_m, block_n, kv_chunk, q.device)
    part_out, part_lse = prefix_attention(q, k_cache, v_cache, work, sm_scale, block_m=block_m, block_n=block_n)
    return merge_partials(own_out, own_lse, part_out, part_lse, work, q.dtype)


def prefix_blocks(q: torch.Tensor, num_kv_heads: int, block_m: int | None,
                  block_n: int | None) -> tuple[int, int]:
    """(tokens, kv block) per prefix-kernel program; rows = tokens x the group's padded heads."""
    block_g = triton.next_power_of_2(q.shape[1] // num_kv_heads)
    default_rows, default_n = _default_blocks(q)
    block_m = block_m or max(1, default_rows // block_g)
    block_n = block_n or default_n
    if block_m * block_g < 16 or block_n < 16:  # tl.dot wants >= 16 rows and columns on a GPU
        raise ValueError(f"prefix_attention: block_m x group ({block_m} x {block_g}) and block_n ({block_n}) "
                         "must be >= 16")
    return block_m, block_n


def prefix_work(meta: AttentionMetadata, num_kv_heads: int, block_m: int, block_n: int,
                kv_chunk: int | None, device: torch.device) -> PrefixWork:
    """The step's PrefixWork, from ``meta.step_cache`` when a previous layer built it."""
    key = ("triton_cascade", num_kv_heads, block_m, block_n, kv_chunk)
    work = meta.step_cache.get(key)
    if work is None:
        work = meta.step_cache[key] = _build_work(meta, num_kv_heads, block_m, block_n, kv_chunk, device)
    return work


def _build_work(meta: AttentionMetadata, num_kv_heads: int, block_m: int, block_n: int,
                kv_chunk: int | None, device: torch.device) -> PrefixWork:
    num_sms = _num_sms(device) if device.type == "cuda" else None
    q_start, q_len, kv_start, kv_len, rows = [], [], [], [], []
    entries = slot_offset = 0
    for plan in meta.shared:
        n_q, n_kv = plan.q_rows.numel(), plan.prefix.num_tokens  # host-known shapes: no sync
        chunk = _chunk_len(n_kv, triton.cdiv(n_q, block_m) * num_kv_heads, block_n, kv_chunk, num_sms)
        for lo in range(0, n_kv, chunk):
            q_start.append(entries)
            q_len.append(n_q)
            kv_start.append(slot_offset + lo)
            kv_len.append(min(chunk, n_kv - lo))
            rows.append(plan.q_rows)
            entries += n_q
        slot_offset += n_kv
    tables = torch.tensor([q_start, q_len, kv_start, kv_len], dtype=torch.int32).to(device, non_blocking=True)
    entry_rows = torch.cat(rows).to(device=device, dtype=torch.int64)
    slots = torch.cat([plan.slots for plan in meta.shared]).to(device=device, dtype=torch.int64)
    # CSR of each token's partial rows; a stable sort keeps item order, so merges are deterministic.
    sorted_rows, order = torch.sort(entry_rows, stable=True)
    num_tokens = sum(meta.q_lens_list)
    indptr = torch.searchsorted(sorted_rows, torch.arange(num_tokens + 1, device=device, dtype=torch.int64))
    return PrefixWork(item_q_start=tables[0], item_q_len=tables[1], item_kv_start=tables[2], item_kv_len=tables[3],
                      entry_rows=entry_rows, slots=slots, merge_order=order, merge_indptr=indptr.to(torch.int32),
                      num_items=len(q_start), num_entries=entries, max_q_len=max(q_len))


def _chunk_len(n_kv: int, programs_per_chunk: int, block_n: int, kv_chunk: int | None,
               num_sms: int | None) -> int:
    """Keys per item: the whole prefix, or (long prefix, few queries) up to MAX_KV_SPLITS chunks,
    no more than the GPU needs to keep every SM busy; whole BLOCK_N blocks either way."""
    if kv_chunk is not None:
        return triton.cdiv(max(kv_chunk, 1), block_n) * block_n
    chunks = min(MAX_KV_SPLITS, triton.cdiv(n_kv, MIN_TOKENS_PER_SPLIT))
    if num_sms is not None:
        chunks = min(chunks, triton.cdiv(PROGRAMS_PER_SM * num_sms, programs_per_chunk))
    return triton.cdiv(triton.cdiv(n_kv, max(1, chunks)), block_n) * block_n


def prefix_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    work: PrefixWork,
    sm_scale: float,
    *,
    block_m: int,
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_entries, num_q_heads, head_dim] fp32, [num_entries, num_q_heads] fp32
    """Unmasked attention of every item's queries over its key chunk, with the natural-log LSE."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = check_attention_inputs(q, k_cache, v_cache)
    out = torch.empty((work.num_entries, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((work.num_entries, num_q_heads), dtype=torch.float32, device=q.device)
    if work.num_entries == 0:
        return out, lse
    grid = (work.num_items, num_kv_heads, triton.cdiv(work.max_q_len, block_m))
    _prefix_kernel[grid](
        q, k_cache, v_cache, out, lse,
        work.item_q_start, work.item_q_len, work.item_kv_start, work.item_kv_len, work.entry_rows, work.slots,
        sm_scale * LOG2_E,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        group, head_dim,
        BLOCK_M=block_m, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PRECISION=DOT_PRECISION,
        num_warps=4, num_stages=2,
    )
    return out, lse


def merge_partials(
    own_out: torch.Tensor,  # [num_tokens, num_q_heads, head_dim] fp32
    own_lse: torch.Tensor,  # [num_tokens, num_q_heads] fp32
    part_out: torch.Tensor,  # [num_entries, num_q_heads, head_dim] fp32
    part_lse: torch.Tensor,  # [num_entries, num_q_heads] fp32
    work: PrefixWork,
    dtype: torch.dtype,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim] in dtype
    """Each token's own partial merged with its shared-prefix partials by log-sum-exp."""
    num_tokens, num_q_heads, head_dim = own_out.shape
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=dtype, device=own_out.device)
    if num_tokens == 0:
        return out
    block_h = min(16, triton.next_power_of_2(num_q_heads))
    _merge_kernel[(num_tokens, triton.cdiv(num_q_heads, block_h))](
        own_out, own_lse, part_out, part_lse, work.merge_order, work.merge_indptr, out,
        num_q_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    return out


@triton.jit
def _prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr,
    item_q_start_ptr, item_q_len_ptr, item_kv_start_ptr, item_kv_len_ptr, entry_rows_ptr, slots_ptr,
    qk_scale,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_s, stride_k_h, stride_k_d,
    stride_v_s, stride_v_h, stride_v_d,
    group, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_block = tl.program_id(2)
    num_q_heads = group * tl.num_programs(1)

    q_len = tl.load(item_q_len_ptr + item)
    if m_block * BLOCK_M >= q_len:
        return  # the grid is sized for the item with the most queries
    q_start = tl.load(item_q_start_ptr + item).to(tl.int64)
    kv_start = tl.load(item_kv_start_ptr + item).to(tl.int64)
    kv_len = tl.load(item_kv_len_ptr + item)

    # Row r of the tile is (entry m_block * BLOCK_M + r // BLOCK_G, q head kv_head * group + r % BLOCK_G).
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    offs_m = m_block * BLOCK_M + offs_r // BLOCK_G  # [rows] query of this item
    offs_g = offs_r % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    r_valid = (offs_m < q_len) & (offs_g < group)
    d_valid = offs_d < head_dim
    entries = q_start + offs_m  # [rows] partial row (int64)
    q_rows = tl.load(entry_rows_ptr + entries, mask=r_valid, other=0)  # [rows] token row of q
    q_heads = kv_head * group + offs_g
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_t + q_heads[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
                mask=r_valid[:, None] & d_valid[None, :], other=0.0)  # [rows, BLOCK_D]

    m_i = tl.full([BLOCK_M * BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    for start_n in range(0, kv_len, BLOCK_N):  # every shared key precedes every query: no mask
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_len
        slots = tl.load(slots_ptr + kv_start + offs_n, mask=n_valid, other=0)  # [BLOCK_N] int64
        k = tl.load(k_cache_ptr + slots[None, :] * stride_k_s + kv_head * stride_k_h + offs_d[:, None] * stride_k_d,
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=PRECISION)  # [rows, BLOCK_N] fp32
        scores = tl.where(n_valid[None, :], qk * qk_scale, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_v_s + kv_head * stride_v_h + offs_d[None, :] * stride_v_d,
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    # out / lse are contiguous [num_entries, num_q_heads(, head_dim)] fp32.
    row = entries * num_q_heads + q_heads  # [rows]
    tl.store(out_ptr + row[:, None] * head_dim + offs_d[None, :], out, mask=r_valid[:, None] & d_valid[None, :])
    tl.store(lse_ptr + row, natural_lse(m_i, l_i), mask=r_valid)


@triton.jit
def _merge_kernel(
    own_out_ptr, own_lse_ptr, part_out_ptr, part_lse_ptr, order_ptr, indptr_ptr, out_ptr,
    num_q_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # All tensors are contiguous: [rows, num_q_heads(, head_dim)].
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_valid = offs_h < num_q_heads
    mask = h_valid[:, None] & (offs_d < head_dim)[None, :]
    tile = offs_h[:, None] * head_dim + offs_d[None, :]  # [BLOCK_H, BLOCK_D]

    m = tl.load(own_lse_ptr + token * num_q_heads + offs_h, mask=h_valid, other=0.0)  # [BLOCK_H]
    acc = tl.load(own_out_ptr + token * num_q_heads * head_dim + tile, mask=mask, other=0.0)
    den = tl.full([BLOCK_H], 1.0, dtype=tl.float32)  # acc is normalised: weight exp(lse - m) = 1
    start = tl.load(indptr_ptr + token)
    end = tl.load(indptr_ptr + token + 1)
    for e in range(start, end):
        part = tl.load(order_ptr + e)  # int64 partial row
        lse = tl.load(part_lse_ptr + part * num_q_heads + offs_h, mask=h_valid, other=0.0)
        o = tl.load(part_out_ptr + part * num_q_heads * head_dim + tile, mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # both -inf (no keys at all): stay 0
        alpha = tl.exp(m - m_safe)
        beta = tl.exp(lse - m_safe)
        acc = acc * alpha[:, None] + o * beta[:, None]
        den = den * alpha + beta
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + token * num_q_heads * head_dim + tile, out.to(out_ptr.dtype.element_ty), mask=mask)
