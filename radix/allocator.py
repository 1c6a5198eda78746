"""KV slot allocator: hands out pages of `page_size` consecutive slots of the KV pool.

The pool is counted in token slots. Page `p` covers slots `[p * page_size, (p + 1) * page_size)`,
so a page is always aligned and contiguous; the allocator only tracks pages. Pure Python: slot ids
are plain ints that the runner in kernels/ turns into tensor indices.
"""

from __future__ import annotations

import logging
from collections import deque

logger = logging.getLogger(__name__)


class KVAllocator:
    """Free list of KV pages. Never hands out a slot twice, refuses to free a slot it did not hand out."""

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0 or num_slots % page_size != 0:
            raise ValueError(
                f"num_slots ({num_slots}) must be a non-negative multiple of page_size ({page_size})"
            )
        self.total_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # FIFO order: a freed page is reused as late as possible, and handing out is deterministic.
        self._free_pages: deque[int] = deque()
        self._page_is_free = bytearray(self.num_pages)
        self.reset()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_used_slots(self) -> int:
        return self.total_slots - self.num_free_slots

    def alloc(self, num_slots: int) -> list[int] | None:
        """Slot ids for `num_slots` slots (a multiple of page_size), whole pages in order.

        Returns None, allocating nothing, when fewer slots are free.
        """
        page_size = self.page_size
        if num_slots < 0 or num_slots % page_size != 0:
            raise ValueError(
                f"alloc needs a non-negative multiple of page_size ({page_size}) slots, got {num_slots}"
            )
        num_pages = num_slots // page_size
        if num_pages > len(self._free_pages):
            return None
        pop = self._free_pages.popleft
        pages = [pop() for _ in range(num_pages)]
        is_free = self._page_is_free
        for page in pages:
            is_free[page] = 0
        if page_size == 1:
            return pages
        offsets = range(page_size)
        return [page * page_size + offset for page in pages for offset in offsets]

    def free(self, slot_ids: list[int]) -> None:
        """Return whole, currently allocated pages. Validates everything before changing anything."""
        if not slot_ids:
            return
        page_size = self.page_size
        distinct = set(slot_ids)
        if len(distinct) != len(slot_ids):
            raise ValueError("free: the same slot id appears twice in one call")
        if min(distinct) < 0 or max(distinct) >= self.total_slots:
            raise ValueError(f"free: slot id outside the pool [0, {self.total_slots})")
        pages = distinct if page_size == 1 else {slot // page_size for slot in distinct}
        # Each page holds at most page_size distinct slots, so equality means every page is complete.
        if len(pages) * page_size != len(distinct):
            raise ValueError(f"free: slot ids must cover whole pages of {page_size} slots")
        is_free = self._page_is_free
        for page in pages:
            if is_free[page]:
                raise ValueError(
                    f"free: slots {page * page_size}..{(page + 1) * page_size - 1} are not allocated "
                    "(double free or foreign slot ids)"
                )
        for page in pages:
            is_free[page] = 1
        self._free_pages.extend(sorted(pages))

    def is_free(self, slot_id: int) -> bool:
        return bool(self._page_is_free[slot_id // self.page_size])

    def reset(self) -> None:
        """Make every slot free again (callers must drop all slot ids they hold)."""
        self._free_pages = deque(range(self.num_pages))
        self._page_is_free = bytearray(b"\x01" * self.num_pages)

    def check_integrity(self) -> None:
        """Free list and free flags agree; no page is listed twice."""
        free_pages = list(self._free_pages)
        assert len(set(free_pages)) == len(free_pages), "allocator: a page is on the free list twice"
        flagged = {page for page, flag in enumerate(self._page_is_free) if flag}
        assert flagged == set(free_pages), "allocator: free list and free flags disagree"

    def __repr__(self) -> str:
        return (
            f"KVAllocator(total_slots={self.total_slots}, page_size={self.page_size}, "
            f"free_slots={self.num_free_slots})"
        )
