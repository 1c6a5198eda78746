"""KV slot allocator: hands out pages of `page_size` consecutive slots of the KV pool.

The pool is counted in token slots. Page `p` covers slots `[p * page_size, (p + 1) * page_size)`,
so a page is always aligned and contiguous; the allocator only tracks pages. Pure Python: slot ids
are plain ints that the runner in kernels/ turns into tensor indices.

Free pages are kept as maximal runs of consecutive pages, and an allocation takes the
lowest-addressed run that holds it whole (first fit), so one request's chunk of new tokens
gets consecutive slots whenever any run is long enough: a cached prefix is then a plain range
of the KV pool, which attention reads as a view instead of gathering it
(ARCHITECTURE §7). Only when no run is long enough is the allocation split across runs.
"""

from __future__ import annotations

import logging

from sortedcontainers import SortedDict

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
        self._runs: SortedDict = SortedDict()  # first free page of a run -> one past its last
        self._num_free_pages = 0
        self._page_is_free = bytearray(self.num_pages)
        self.reset()

    @property
    def num_free_slots(self) -> int:
        return self._num_free_pages * self.page_size

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
        if num_pages > self._num_free_pages:
            return None
        if num_pages == 0:
            return []
        pages = self._take_pages(num_pages)
        is_free = self._page_is_free
        for page in pages:
            is_free[page] = 0
        self._num_free_pages -= num_pages
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
        self._num_free_pages += len(pages)
        self._add_runs(sorted(pages))

    def is_free(self, slot_id: int) -> bool:
        return bool(self._page_is_free[slot_id // self.page_size])

    def reset(self) -> None:
        """Make every slot free again (callers must drop all slot ids they hold)."""
        self._runs = SortedDict({0: self.num_pages} if self.num_pages else {})
        self._num_free_pages = self.num_pages
        self._page_is_free = bytearray(b"\x01" * self.num_pages)

    def check_integrity(self) -> None:
        """Free runs and free flags agree; runs are disjoint, non-empty and maximal."""
        free_pages: list[int] = []
        prev_end = -1
        for start, end in self._runs.items():
            assert start < end, "allocator: an empty free run"
            assert start > prev_end, "allocator: free runs overlap or touch (not coalesced)"
            free_pages.extend(range(start, end))
            prev_end = end
        assert len(free_pages) == self._num_free_pages, "allocator: free count disagrees with the runs"
        flagged = {page for page, flag in enumerate(self._page_is_free) if flag}
        assert flagged == set(free_pages), "allocator: free runs and free flags disagree"

    @property
    def num_free_runs(self) -> int:
        return len(self._runs)

    # -- free runs ------------------------------------------------------------------------

    def _take_pages(self, num_pages: int) -> list[int]:
        """Pages from the first run that holds num_pages whole, else from the lowest runs."""
        runs = self._runs
        for start, end in runs.items():
            if end - start >= num_pages:
                del runs[start]
                if end - start > num_pages:
                    runs[start + num_pages] = end
                return list(range(start, start + num_pages))
        pages: list[int] = []
        while len(pages) < num_pages:
            start, end = runs.popitem(0)
            take = min(end - start, num_pages - len(pages))
            pages.extend(range(start, start + take))
            if start + take < end:
                runs[start + take] = end
        return pages

    def _add_runs(self, pages: list[int]) -> None:
        """Return sorted pages as runs, merged with the free runs they touch."""
        runs = self._runs
        i = 0
        while i < len(pages):
            start = end = pages[i]
            while i < len(pages) and pages[i] == end:
                end += 1
                i += 1
            if end in runs:  # the next free run starts where this one ends
                end = runs.pop(end)
            pos = runs.bisect_left(start)
            if pos > 0:
                prev_start = runs.keys()[pos - 1]
                if runs[prev_start] == start:
                    start = prev_start
            runs[start] = end

    def __repr__(self) -> str:
        return (
            f"KVAllocator(total_slots={self.total_slots}, page_size={self.page_size}, "
            f"free_slots={self.num_free_slots})"
        )
