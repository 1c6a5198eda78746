"""Attention-backend interface shared by the torch reference and the Triton kernels.

Every forward step attends over the paged KV pool. The runner first writes the step's
new K/V into the pool (``store_kv``), then each backend reads *all* K/V of a sequence
(cached prefix + new tokens) through ``kv_indices``:

    flattened batch of new tokens (q):   | seq0 new | seq1 new | seq2 new |
                                          ^qo_indptr[0]        ^qo_indptr[2]
    kv slots per sequence (kv_indices):  | seq0 prefix+new | seq1 prefix+new | ...
                                          ^kv_indptr[0]

Query j of sequence i sits at absolute position ``prefix_lens[i] + j`` and attends to
kv positions ``[max(0, pos - sliding_window + 1), pos]`` (no window: ``[0, pos]``).
Slot indices are token-level, so page size does not change the kernels' contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step index tensors, built once by the runner and shared by all layers."""

    qo_indptr: torch.Tensor  # [num_seqs + 1] int32, ranges of each seq's new tokens
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32, ranges into kv_indices
    kv_indices: torch.Tensor  # [total_kv] int64, KV slot of every position of every seq
    prefix_lens: torch.Tensor  # [num_seqs] int32, kv_len - q_len
    kv_lens: torch.Tensor  # [num_seqs] int32
    out_slot_ids: torch.Tensor  # [num_tokens] int64, where the new K/V is written
    max_q_len: int
    max_kv_len: int
    # Python copies for host-side loops (the torch reference), avoiding device syncs.
    q_lens_list: list[int]
    kv_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_list)

    @property
    def is_decode(self) -> bool:
        """True when every sequence contributes exactly one new token."""
        return self.max_q_len == 1


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into its pool slice, then attends over the pool."""

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
        ...
