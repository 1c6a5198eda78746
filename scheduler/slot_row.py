"""A request's KV slot list and its row of the runner's request->slot table: the one owner of both (ARCHITECTURE §6).

The runner keeps a [max_running_requests, context] table of slots that the attention reads, one row per running
request (kernels/runner.py owns the tensor). A step sends each request only what its row lacks. `SlotRow` is the
request's side of that row:

    slots:  the slots of positions [0, kv_len) plus those taken ahead (whole pages);
    row:    the table row it holds while it holds KV (None otherwise);
    synced: how many leading `slots` the row already holds;
    penalty_fed: how many output tokens the row's penalty statistics hold (None: none since the row was assigned,
            so the next feed is the whole context).

Every change to a slot list goes through a SlotRow method, so `synced` stays true: appending leaves it alone,
adopting the tree's copies of a range lowers it to the range's start, and `take_unsynced` hands a step what the row
lacks. `SlotRows` hands rows out and takes them back. Which slots a request holds is decided in kv_ops.PrefixKV;
this module only records them. Invariant (tests/test_engine_step.py's state machine): after every step, the
runner's row holds `slots[:synced]`.
"""
from __future__ import annotations

from ..kernels.forward_io import PenaltyTokens


class SlotRow:
    __slots__ = ("slots", "row", "synced", "fresh", "penalty_fed")

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.row: int | None = None
        self.synced = 0
        self.fresh = False  # no step has used the row since it was assigned
        self.penalty_fed: int | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def extend(self, slots: list[int]) -> None:
        """Slots for the next positions (freshly allocated): the row lacks them until the next step."""
        self.slots.extend(slots)

    def adopt(self, start: int, tree_slots: list[int]) -> None:
        """Replace `slots[start:start + len(tree_slots)]` by the tree's copies of that range (the tree cached the same
        tokens first; the caller freed its own); the row gets them again from `start` on."""
        if tree_slots:
            self.slots[start:start + len(tree_slots)] = tree_slots
            self.synced = min(self.synced, start)

    def take_unsynced(self, limit: int) -> tuple[int, list[int], bool]:
        """What the row lacks among the first `limit` slots: (its first position, the slots, whether the row is new
        to the runner); from now on the row counts as holding them."""
        hi = min(len(self.slots), limit)
        offset, fresh = self.synced, self.fresh
        self.synced, self.fresh = max(hi, offset), False
        return offset, self.slots[offset:hi], fresh


    def take_penalty_tokens(self, prompt_ids: list[int], output_ids: list[int]) -> PenaltyTokens:
        """What the row's penalty statistics lack: the whole context on the first feed since the row was
        assigned, then the output tokens generated since the previous feed."""
        fed, self.penalty_fed = self.penalty_fed, len(output_ids)
        if fed is None or fed > len(output_ids):
            return PenaltyTokens(True, tuple(prompt_ids), tuple(output_ids))
        return PenaltyTokens(False, (), tuple(output_ids[fed:]))


class SlotRows:
    """The rows of the runner's request->slot table: one per request that holds KV."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows - 1, -1, -1))  # a stack: row 0 is handed out first

    def assign(self, kv: SlotRow, prefix_slots: list[int]) -> None:
        """A row for a request starting with the cached prefix's slots; the whole row is sent on its first step."""
        if not self._free:
            raise RuntimeError("no free row in the request->slot table (more running requests than "
                               "max_running_requests)")
        kv.row, kv.slots, kv.synced, kv.fresh = self._free.pop(), list(prefix_slots), 0, True
        kv.penalty_fed = None

    def release(self, kv: SlotRow) -> list[int]:
        """Take the row back; returns the slots the request held (the caller frees or caches them)."""
        slots = kv.slots
        if kv.row is not None:
            self._free.append(kv.row)
        kv.row, kv.slots, kv.synced, kv.fresh, kv.penalty_fed = None, [], 0, False, None
        return slots
