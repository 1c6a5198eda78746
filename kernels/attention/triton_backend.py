"""Triton attention backend: store new K/V, then split-K decode or extend attention.

With shared prefixes in the step (``meta.shared``), cascade attention (``triton_cascade``):
each sequence's own keys through the extend / decode kernel, each shared prefix once for all
queries below it, merged by log-sum-exp. Sliding-window layers take the plain path over every
position (``kv_indices`` holds them all), so the shared-prefix kernel needs no window mask.

On a CUDA device the kernels compile for the GPU. On the CPU they only run under the
Triton interpreter, which must be switched on (``TRITON_INTERPRET=1``) *before* this module
is first imported, because ``@triton.jit`` picks compiled vs interpreted at decoration time.
"""
from __future__ import annotations

import logging

import torch

from .base import AttentionMetadata
from .triton_cascade import cascade_attention
from .triton_decode import decode_attention
from .triton_extend import extend_attention
from .triton_store import kernels_interpreted, store_kv

logger = logging.getLogger(__name__)


class TritonAttentionBackend:
    """Same contract as ``TorchAttentionBackend``; q, k, v and the pool share one dtype."""

    name = "triton"
    needs_kv_indices = True  # the extend / decode kernels read every position's slot from kv_indices

    def prepare(self, meta: AttentionMetadata, group: int, windows: set[int | None]) -> None:
        """Nothing to build ahead: the cascade's lookup tables are built on the device, without a
        host sync, by the first layer that needs them."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        sm_scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        _check_device(q)
        store_kv(k_cache, v_cache, k, v, meta.out_slot_ids)
        if meta.shared:  # (a sliding window takes the plain path inside)
            return cascade_attention(q, k_cache, v_cache, meta, sm_scale, sliding_window)
        if meta.is_decode:
            return decode_attention(q, k_cache, v_cache, meta, sm_scale, sliding_window)
        return extend_attention(q, k_cache, v_cache, meta, sm_scale, sliding_window)


def _check_device(q: torch.Tensor) -> None:
    if q.is_cuda or kernels_interpreted():
        return
    raise ValueError(
        "attention_backend='triton' needs a CUDA device, or the Triton interpreter on the CPU: "
        "set TRITON_INTERPRET=1 in the environment before radixserve is imported "
        "(or use attention_backend='torch')")
