import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from radixserve.radix import KVAllocator


def test_alloc_hands_out_distinct_slots_until_full():
    allocator = KVAllocator(8)
    first = allocator.alloc(5)
    second = allocator.alloc(3)
    assert len(first) == 5 and len(second) == 3
    assert sorted(first + second) == list(range(8))
    assert allocator.num_free_slots == 0
    assert allocator.alloc(1) is None
    assert allocator.alloc(0) == []


def test_alloc_none_allocates_nothing():
    allocator = KVAllocator(8)
    allocator.alloc(6)
    assert allocator.alloc(4) is None
    assert allocator.num_free_slots == 2
    assert len(allocator.alloc(2)) == 2


def test_pages_are_aligned_and_consecutive():
    allocator = KVAllocator(32, page_size=4)
    allocator.free(allocator.alloc(8)[4:])  # leave a hole so later pages come from different places
    slot_ids = allocator.alloc(16)
    assert len(slot_ids) == 16 and len(set(slot_ids)) == 16
    for start in range(0, 16, 4):
        page = slot_ids[start:start + 4]
        assert page[0] % 4 == 0 and page == list(range(page[0], page[0] + 4))
    allocator.check_integrity()


def test_double_free_and_foreign_free_are_refused():
    allocator = KVAllocator(8)
    slot_ids = allocator.alloc(4)
    allocator.free(slot_ids[:2])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(slot_ids[:1])  # double free
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([7])  # never handed out
    with pytest.raises(ValueError, match="outside"):
        allocator.free([8])
    with pytest.raises(ValueError, match="twice"):
        allocator.free([slot_ids[2], slot_ids[2]])
    assert allocator.num_free_slots == 6


def test_free_is_all_or_nothing():
    allocator = KVAllocator(8)
    slot_ids = allocator.alloc(4)
    with pytest.raises(ValueError):
        allocator.free([slot_ids[0], 6])  # slot 6 is free: the valid part must not be freed either
    assert allocator.num_free_slots == 4
    allocator.free(slot_ids)
    assert allocator.num_free_slots == 8


def test_partial_page_free_is_refused():
    allocator = KVAllocator(16, page_size=4)
    slot_ids = allocator.alloc(8)
    with pytest.raises(ValueError, match="whole pages"):
        allocator.free(slot_ids[:3])
    with pytest.raises(ValueError, match="whole pages"):
        allocator.free(slot_ids[1:5])
    allocator.free(slot_ids[4:8])
    assert allocator.num_free_slots == 12


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        KVAllocator(10, page_size=4)
    with pytest.raises(ValueError):
        KVAllocator(8, page_size=0)
    allocator = KVAllocator(16, page_size=4)
    with pytest.raises(ValueError, match="multiple"):
        allocator.alloc(3)


def test_reset_frees_everything():
    allocator = KVAllocator(12, page_size=2)
    allocator.alloc(10)
    allocator.reset()
    assert allocator.num_free_slots == 12
    assert sorted(allocator.alloc(12)) == list(range(12))
    allocator.check_integrity()


def test_radix_does_not_import_torch():
    code = "import sys, radixserve.radix; assert 'torch' not in sys.modules, 'radix imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- free runs: first fit, coalescing, splitting ------------------------------------------------

def _pages(page_size, *pages):
    """Slot ids of these pages, in order."""
    return [p * page_size + o for p in pages for o in range(page_size)]


def _checked(allocator, result):
    allocator.check_integrity()
    return result


@pytest.mark.parametrize("page_size", [1, 4])
def test_first_fit_after_fragmentation_gives_consecutive_slots(page_size):
    allocator = KVAllocator(32 * page_size, page_size=page_size)
    blocks = [_checked(allocator, allocator.alloc(n * page_size)) for n in (4, 4, 8, 4, 12)]
    assert blocks[1] == _pages(page_size, 4, 5, 6, 7) and allocator.num_free_slots == 0
    _checked(allocator, allocator.free(blocks[1]))  # free pages 4..7
    _checked(allocator, allocator.free(blocks[3]))  # free pages 16..19
    assert allocator.num_free_runs == 2
    # 3 pages fit in both runs: the lowest wins, and the slots are one consecutive range.
    assert _checked(allocator, allocator.alloc(3 * page_size)) == list(range(4 * page_size, 7 * page_size))
    # 2 pages do not fit in what is left of the first run (page 7): the second run.
    assert _checked(allocator, allocator.alloc(2 * page_size)) == _pages(page_size, 16, 17)
    assert _checked(allocator, allocator.alloc(page_size)) == _pages(page_size, 7)  # the hole at 7, lowest
    assert _checked(allocator, allocator.alloc(2 * page_size)) == _pages(page_size, 18, 19)
    assert allocator.num_free_runs == 0 and allocator.alloc(page_size) is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_frees_coalesce_into_one_run(page_size):
    allocator = KVAllocator(64 * page_size, page_size=page_size)
    blocks = [allocator.alloc(n * page_size) for n in (1, 3, 2, 7, 1, 1, 5, 4, 8, 32)]
    assert allocator.num_free_runs == 0
    for i in (3, 1, 5, 0, 9, 2, 8, 4, 7, 6):  # an order that makes holes and then fills them
        allocator.free(blocks[i])
        allocator.check_integrity()
    assert allocator.num_free_runs == 1 and allocator.num_free_slots == 64 * page_size
    assert allocator.alloc(64 * page_size) == list(range(64 * page_size))
    # A freed page between two free runs joins them (merging on both sides at once).
    allocator.free(_pages(page_size, 10, 12))
    assert allocator.num_free_runs == 2
    allocator.free(_pages(page_size, 11))
    assert allocator.num_free_runs == 1 and _checked(allocator, allocator.alloc(3 * page_size)) == _pages(
        page_size, 10, 11, 12)


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocation_larger_than_any_run_is_split_lowest_first(page_size):
    allocator = KVAllocator(16 * page_size, page_size=page_size)
    singles = [allocator.alloc(page_size) for _ in range(16)]
    assert singles == [_pages(page_size, p) for p in range(16)]
    for page in (11, 1, 9, 5, 2, 10):  # free runs [1, 3), [5, 6), [9, 12)
        allocator.free(singles[page])
    allocator.check_integrity()
    assert allocator.num_free_runs == 3
    # 5 pages: no run holds them, so the lowest runs are used up in address order.
    assert _checked(allocator, allocator.alloc(5 * page_size)) == _pages(page_size, 1, 2, 5, 9, 10)
    assert allocator.num_free_runs == 1 and allocator.num_free_slots == page_size
    assert allocator.alloc(2 * page_size) is None  # nothing changes on a refusal
    assert _checked(allocator, allocator.alloc(page_size)) == _pages(page_size, 11)


def _runs(free_pages):
    """Maximal runs [start, end) of a set of pages, lowest first."""
    runs = []
    for page in sorted(free_pages):
        if runs and runs[-1][1] == page:
            runs[-1][1] += 1
        else:
            runs.append([page, page + 1])
    return runs


def _expected_pages(free_pages, num_pages):
    """The model of alloc: the first run that holds num_pages whole, else the lowest free pages."""
    for start, end in _runs(free_pages):
        if end - start >= num_pages:
            return list(range(start, start + num_pages))
    return sorted(free_pages)[:num_pages]


def make_allocator_machine(num_pages: int, page_size: int) -> type:
    class AllocatorMachine(RuleBasedStateMachine):
        """KVAllocator against a set of free pages and the list of allocations handed out."""

        def __init__(self):
            super().__init__()
            self.allocator = KVAllocator(num_pages * page_size, page_size=page_size)
            self.free_pages = set(range(num_pages))
            self.held: list[list[int]] = []  # pages of each live allocation

        @rule(num=st.integers(0, num_pages + 2))
        def alloc(self, num):
            slots = self.allocator.alloc(num * page_size)
            if num > len(self.free_pages):
                assert slots is None
                return
            pages = _expected_pages(self.free_pages, num)
            assert slots == _pages(page_size, *pages)
            self.free_pages.difference_update(pages)
            if pages:
                self.held.append(pages)

        @precondition(lambda self: self.held)
        @rule(data=st.data())
        def free(self, data):
            """Free an allocation, or some of its pages (in any order)."""
            i = data.draw(st.integers(0, len(self.held) - 1))
            pages = self.held.pop(i)
            part = data.draw(st.lists(st.sampled_from(pages), min_size=1, unique=True))
            rest = [p for p in pages if p not in part]
            if rest:
                self.held.append(rest)
            self.allocator.free(_pages(page_size, *part))
            self.free_pages.update(part)

        @precondition(lambda self: self.free_pages)
        @rule(data=st.data())
        def bad_free_changes_nothing(self, data):
            page = data.draw(st.sampled_from(sorted(self.free_pages)))
            with pytest.raises(ValueError):
                self.allocator.free(_pages(page_size, page))
            if self.held:  # a valid page next to a free one: all or nothing
                with pytest.raises(ValueError):
                    self.allocator.free(_pages(page_size, self.held[0][0], page))

        @rule()
        def reset(self):
            self.allocator.reset()
            self.free_pages = set(range(num_pages))
            self.held = []

        @invariant()
        def agrees_with_the_model(self):
            self.allocator.check_integrity()
            assert self.allocator.num_free_slots == len(self.free_pages) * page_size
            assert self.allocator.num_free_runs == len(_runs(self.free_pages))
            assert all(self.allocator.is_free(p * page_size) == (p in self.free_pages) for p in range(num_pages))

    return AllocatorMachine


@pytest.mark.parametrize("num_pages,page_size", [(24, 1), (12, 4)])
def test_alloc_free_sequences_against_a_model(num_pages, page_size):
    run_state_machine_as_test(make_allocator_machine(num_pages, page_size),
                              settings=settings(max_examples=60, stateful_step_count=40, deadline=None))
