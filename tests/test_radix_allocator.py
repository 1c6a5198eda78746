import subprocess
import sys

import pytest

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
