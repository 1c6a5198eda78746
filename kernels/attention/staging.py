"""Decode own-key staging for the CPU backend: gathered own K/V kept from one step to the next.

A decode bucket's own keys (``torch_backend._Bucket`` with a gather index) are a padded
``[num, max_k]`` block of pool slots. Gathering it costs a full copy of every member's private
history, per layer, per step; yet the next decode step of the same members needs the same keys
plus one new key each. A ``Stage`` keeps the gathered block of every layer (``[num, cap]`` cells,
``cap`` with headroom, head-major) between steps and records which slot each cell holds; a step
then copies only the cells whose slot changed and the cells of keys computed in this step (their
K/V are written by this very step, so an equal slot id proves nothing about them). Every other
cell holds a slot the same sequence referenced in the previous step and still references, whose
K/V cannot have changed: a referenced slot is never freed, so never rewritten.

A stage lives while a bucket with the same member rows (in order) and the same sliding window
(the layers of one window share a bucket plan) exists in consecutive steps; one that no bucket
used in a step is dropped. Its memory is bounded by ``budget_slots`` pool slots' worth (a bucket
past it is gathered per layer, as without stages). Exactness does not depend on any of this:
every cell read holds the K/V of the slot the bucket's gather index names.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

HEADROOM = 64  # extra key columns a new stage reserves, so it grows by a re-stage at most every HEADROOM steps


@dataclass
class Stage:
    """A bucket's gathered own keys of every layer: cells [num, cap], each holding slot ``slots[i, c]``."""

    num: int
    cap: int
    slots: torch.Tensor  # [num, cap] int64, the slot each cell holds (-1 = none yet)
    # per layer: K, V [num, kv_heads, cap, d] and the refresh that layer last took
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    epoch: int = 0  # refreshes so far; a layer that missed one (a step cut short) copies every cell
    # This step's refresh: the stale cells (member, column) and the slots they take; full_src
    # [num, max_k] is the whole gather index, for a layer that copies every cell.
    seq: torch.Tensor | None = None
    col: torch.Tensor | None = None
    src: torch.Tensor | None = None
    full_src: torch.Tensor | None = None

    @property
    def cells(self) -> int:
        return self.num * self.cap


@dataclass
class StageCounters:
    """Cells copied into stages and cells read that were already there (``stats()`` shows them)."""

    copied: int = 0
    reused: int = 0


class OwnKeyStages:
    """The backend's stages, carried from the previous step to the next."""

    def __init__(self, budget_slots: int | None = None) -> None:
        # A cell holds one slot's K/V of every layer, so the budget counts pool slots (None: no limit).
        self.budget_slots = budget_slots
        self._stages: dict[tuple, Stage] = {}
        self.counters = StageCounters()

    def refresh(self, plans: list[tuple[tuple, torch.Tensor, tuple[int, ...]]]) -> list[Stage | None]:
        """plans: per decode bucket (key: its window and member rows; gather index [num, max_k]; each
        member's own keys k_len): cells c < k_len hold keys, c == k_len - 1 the key this step computes,
        the rest is masked padding. Returns each bucket's stage (None: over budget, gather per layer)
        with its refresh set; drops the stages no bucket used."""
        kept: dict[tuple, Stage] = {}
        out: list[Stage | None] = []
        used = 0
        for key, idx, k_lens in plans:
            num, max_k = idx.shape
            stage = self._stages.get(key)
            if stage is None or stage.cap < max_k or key in kept:
                stage = Stage(num=num, cap=max_k + HEADROOM,
                              slots=torch.full((num, max_k + HEADROOM), -1, dtype=torch.int64, device=idx.device))
            if self.budget_slots is not None and used + stage.cells > self.budget_slots:
                out.append(None)
                continue
            used += stage.cells
            col = torch.arange(max_k, device=idx.device)[None, :]
            k_len = torch.tensor(k_lens, dtype=torch.int64, device=idx.device)[:, None]
            valid = col < k_len
            held = stage.slots[:, :max_k]
            stale = valid & ((held != idx) | (col == k_len - 1))
            cells = torch.nonzero(stale.flatten()).flatten()  # of num * max_k
            stage.seq, stage.col = cells // max_k, cells % max_k
            stage.src = idx.flatten().index_select(0, cells)
            stage.full_src = idx
            held.copy_(torch.where(valid, idx, -1))  # padding cells hold nothing that counts
            stage.epoch += 1
            self.counters.copied += cells.numel()
            self.counters.reused += sum(k_lens) - cells.numel()
            kept[key] = stage
            out.append(stage)
        self._stages = kept
        return out

    def clear(self) -> None:
        self._stages = {}


def staged_keys(stage: Stage, k_cache: torch.Tensor, v_cache: torch.Tensor, max_k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's staged K / V [num, kv_heads, max_k, d] (views of head-major buffers, so each head's
    keys are one contiguous block for the matmuls), refreshed from the pool first."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    layer = k_cache.data_ptr()  # the pool slice of one layer: one buffer pair per layer
    entry = stage.buffers.get(layer)
    if entry is None:
        shape = (stage.num, num_kv_heads, stage.cap, head_dim)
        entry = (k_cache.new_zeros(shape), v_cache.new_zeros(shape), -1)  # never NaN under a mask
    k_buf, v_buf, synced = entry
    if synced != stage.epoch:
        for buf, cache in ((k_buf, k_cache), (v_buf, v_cache)):
            if synced == stage.epoch - 1:  # held every cell as of the previous refresh: the stale ones
                if stage.src.numel():
                    buf.transpose(1, 2).index_put_((stage.seq, stage.col), cache.index_select(0, stage.src))
            else:  # new, or missed a refresh: every cell, padding included (it repeats a real key)
                rows = cache.index_select(0, stage.full_src.flatten()).view(stage.num, max_k, num_kv_heads, head_dim)
                buf[:, :, :max_k].copy_(rows.transpose(1, 2))
        stage.buffers[layer] = (k_buf, v_buf, stage.epoch)
    return k_buf[:, :, :max_k], v_buf[:, :, :max_k]
