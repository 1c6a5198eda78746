"""Attention-backend interface shared by the torch backend and the Triton kernels.

Every forward step attends over the paged KV pool. The runner first writes the step's
new K/V into the pool (``store_kv``), then each backend reads the K/V of a sequence
(cached prefix + new tokens) through the request->slot table (or ``kv_indices``, the same
slots flattened, for kernels that read it):

    flattened batch of new tokens (q):   | seq0 new | seq1 new | seq2 new |
                                          ^qo_indptr[0]        ^qo_indptr[2]
    kv slots per sequence (kv_indices):  | seq0 prefix+new | seq1 prefix+new | ...
                                          ^kv_indptr[0]

Query j of sequence i sits at absolute position ``kv_lens[i] - q_lens[i] + j`` and attends to
kv positions ``[max(0, pos - sliding_window + 1), pos]`` (no window: ``[0, pos]``).
Slot indices are token-level, so page size does not change the kernels' contract.

Shared prefixes (cascade attention, ARCHITECTURE §7). Sequences below one radix node hold the
same slots for that node's positions. ``shared`` lists key ranges read once for all queries of
the sequences below them; each sequence's remaining keys ``[own_start, kv_len)`` are its own:

    seq a:  | shared 0 ..........| shared 1 ....| own (causal) |
    seq b:  | shared 0 ..........| shared 1 ....| own ...... |
    seq c:  | shared 0 ..........| own ................. |
            0                    own_start(c)   own_start(a), own_start(b)

For a sequence, its shared ranges tile ``[0, own_start)`` without gaps, and every shared key
precedes all of its queries (shared KV was computed in earlier steps), so the shared part needs
no causal mask. Partial results are merged by their log-sum-exp. Exact: the same softmax over
the same keys, summed in another order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class SharedPrefix:
    """Key positions [kv_start, kv_end) held in the same slots by every sequence of seq_idx."""

    kv_start: int
    kv_end: int
    seq_idx: list[int]  # >= 2 sequences of the batch, in batch order

    @property
    def num_tokens(self) -> int:
        return self.kv_end - self.kv_start


@dataclass
class SharedPrefixPlan:
    """A SharedPrefix with its step tensors (built once per step by the runner)."""

    prefix: SharedPrefix
    slots: torch.Tensor  # [num_tokens] int64, the KV slots of the shared positions
    q_rows: torch.Tensor  # [num_q] int64, token rows (into q) of every query below the prefix


@dataclass
class AttentionMetadata:
    """Per-step index tensors, built once by the runner and shared by all layers."""

    qo_indptr: torch.Tensor  # [num_seqs + 1] int32, ranges of each seq's new tokens
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32, ranges into kv_indices
    kv_lens: torch.Tensor  # [num_seqs] int32
    out_slot_ids: torch.Tensor  # [num_tokens] int64, where the new K/V is written
    max_q_len: int
    max_kv_len: int
    # Python copies for host-side planning, avoiding device syncs.
    q_lens_list: list[int]
    kv_lens_list: list[int]
    # [total_kv] int64, KV slot of every position of every seq; built only for backends that
    # read it (``AttentionBackend.needs_kv_indices``), from the slot table on the device.
    kv_indices: torch.Tensor | None = None
    slot_table: torch.Tensor | None = None  # [max_rows, row_width] int64, the runner's table
    rows: torch.Tensor | None = None  # [num_seqs] int64, each seq's row of slot_table
    rows_list: list[int] | None = None  # the same on the host
    own_start_list: list[int] | None = None  # first key position outside shared prefixes
    own_start: torch.Tensor | None = None  # [num_seqs] int32, the same on the device
    shared: list[SharedPrefixPlan] = field(default_factory=list)
    # Derived tensors a backend builds on first use in a step and reuses in every layer.
    step_cache: dict[Any, Any] = field(default_factory=dict)
    counters: Any = None  # metadata.HostCounters of the step: a backend's plan counts its host tensors too

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_list)

    @property
    def is_decode(self) -> bool:
        """True when every sequence contributes exactly one new token."""
        return self.max_q_len == 1

    def own_starts(self) -> list[int]:
        return self.own_start_list if self.own_start_list is not None else [0] * self.num_seqs


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into its pool slice, then attends over the pool."""

    name: str
    needs_kv_indices: bool  # the runner builds meta.kv_indices only for backends that read it

    def prepare(self, meta: AttentionMetadata, group: int, windows: set[int | None]) -> None:
        """Called once per step before the first layer: build whatever the layers reuse
        (into meta.step_cache), so no layer syncs with the host. ``windows`` are the sliding
        windows of the model's layers (None = full attention)."""
        ...

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
