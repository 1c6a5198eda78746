"""The CPU attention backend: own-part attention in a few buckets plus shared-prefix (cascade)
attention, through one reader.

Per step, ``torch_plan.step_plan`` (once, before the first layer) turns the batch into buckets of
own-part query units and one batch of shared prefixes per nesting level. Per layer: one call per
bucket writes every token's result over its own keys, then one call per level merges each shared
prefix, read once for *all* queries below it, into just the rows below it by log-sum-exp.
Sliding-window layers take the plain path (own keys = all keys).

The reader is radixserve's compiled kernel (``native.attend_tokens``: fp32, bf16 or int8 K/V read by
slot in place, q read and the result written by token, the merge inside the kernel) wherever
``native.supports`` the pool; elsewhere (no C compiler, another head_dim or device) its torch
twin ``partials.attend_tokens``, the same contract over gathered K/V and torch's flash op. GQA
without copying K/V: the ``group`` q heads of one kv head are stacked along the query axis (row
r = token r // group, head r % group), so K/V keep their kv-head layout.
"""
from __future__ import annotations

import torch

from .. import native as native_kernel
from . import partials
from .base import AttentionMetadata
from .kv_int8 import read_dtype
from .torch_plan import step_plan
from .torch_ref import store_kv


class TorchAttentionBackend:
    """Store, then bucketed own-part attention + shared prefixes, merged by log-sum-exp."""

    name = "torch"
    needs_kv_indices = False

    def __init__(self, native: bool = False) -> None:
        self.native = native  # reads go to native.py's kernel (the caller checked native_kernel.supports)

    def prepare(self, meta: AttentionMetadata, group: int, windows: set[int | None]) -> None:
        for window in windows:
            window = window if window is not None and window > 0 else None
            step_plan(meta, window, group, bool(meta.shared) and window is None)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, sm_scale: float,
                sliding_window: int | None) -> torch.Tensor:
        store_kv(k_cache, v_cache, k, v, meta.out_slot_ids)
        return cascade_attention(q, k_cache, v_cache, meta, sm_scale, sliding_window, native=self.native)


def cascade_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    native: bool | None = None,  # None: the native kernel wherever it supports the pool
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim], q's dtype
    """Causal attention of each sequence's new tokens over its KV (same result as
    ``torch_ref.extend_attention``), reading every shared prefix of ``meta.shared`` once.

    Nothing is copied around the reader: it reads q and writes the fp32 result and LSE by token,
    each bucket's own part first, then each level of shared prefixes merged into the rows below
    it, so a step pays merge work only for the queries that sit below a shared prefix."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    group = q.shape[1] // k_cache.shape[1]
    dtype = q.dtype
    q_dtype = read_dtype(k_cache, dtype)  # the pool's (the model's); over an int8 pool q's own
    if native is None:
        native = native_kernel.supports(q_dtype, k_cache.shape[2], k_cache.device)
    plan = step_plan(meta, window, group, bool(meta.shared) and window is None)
    read = native_kernel.attend_tokens if native else partials.attend_tokens
    q = q.to(q_dtype)  # the kernel reads q, K and V in one dtype, or q in its own over int8 K / V
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for b in plan.buckets:  # the own parts cover every token: every token sees itself
        read(q, k_cache, v_cache, b.slots, b.bounds, b.tokens, sm_scale, out, lse, merge=False)
    for batch in plan.shared_batches:
        read(q, k_cache, v_cache, batch.slots, batch.bounds, batch.tokens, sm_scale, out, lse, merge=True)
    return out.to(dtype)
