"""Triton kernel that writes a step's new K/V into the paged pool by slot id.

Slot ids are token-level, so a program copies BLOCK_T tokens' K and V rows
(``num_kv_heads x head_dim`` each) to ``k_cache[slot]`` / ``v_cache[slot]``; page size never
appears. Same signature as ``torch_ref.store_kv``.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)


def store_kv(
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    out_slot_ids: torch.Tensor,  # [num_tokens] int64
    *,
    block_t: int | None = None,
) -> None:
    """Write ``k``/``v`` rows to the pool at ``out_slot_ids`` (cast to the pool dtype)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or out_slot_ids.shape != (num_tokens,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and "
                         f"out_slot_ids {tuple(out_slot_ids.shape)} do not match")
    if k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: pool {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    if num_tokens == 0:
        return
    # The interpreter pays per program, a GPU per idle lane: many tokens per program vs few.
    block_t = block_t or (64 if kernels_interpreted() else 4)
    row_len = num_kv_heads * head_dim
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k_cache, v_cache, k, v, out_slot_ids,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        num_tokens, head_dim, row_len,
        BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(row_len),
    )


def kernels_interpreted() -> bool:
    """True when this process's kernels were built for the Triton interpreter (CPU tensors).

    ``triton.jit`` decides at import time from TRITON_INTERPRET, so this is fixed per process.
    """
    return type(_store_kv_kernel).__name__ == "InterpretedFunction"


@triton.jit
def _store_kv_kernel(
    k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_ids_ptr,
    stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_s, stride_vc_h, stride_vc_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    num_tokens, head_dim, row_len,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # Each token's K (and V) row is num_kv_heads * head_dim elements, flattened to e.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] tokens
    offs_e = tl.arange(0, BLOCK_E)
    head = offs_e // head_dim
    dim = offs_e % head_dim
    t_valid = offs_t < num_tokens
    mask = t_valid[:, None] & (offs_e[None, :] < row_len)  # [BLOCK_T, BLOCK_E]
    slots = tl.load(slot_ids_ptr + offs_t, mask=t_valid, other=0).to(tl.int64)  # 64-bit: big pools
    rows = offs_t.to(tl.int64)

    k_rows = tl.load(k_ptr + rows[:, None] * stride_k_t + (head * stride_k_h + dim * stride_k_d)[None, :], mask=mask)
    v_rows = tl.load(v_ptr + rows[:, None] * stride_v_t + (head * stride_v_h + dim * stride_v_d)[None, :], mask=mask)
    tl.store(k_cache_ptr + slots[:, None] * stride_kc_s + (head * stride_kc_h + dim * stride_kc_d)[None, :],
             k_rows.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slots[:, None] * stride_vc_s + (head * stride_vc_h + dim * stride_vc_d)[None, :],
             v_rows.to(v_cache_ptr.dtype.element_ty), mask=mask)
