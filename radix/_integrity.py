"""Full-walk consistency check for RadixCache (tests and debug builds; O(cached slots))."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .radix_cache import RadixCache, TreeNode


def check_cache_integrity(cache: RadixCache, in_flight_slots: int | Collection[int] = 0) -> None:
    """Raise AssertionError naming the first broken invariant."""
    allocator = cache.allocator
    allocator.check_integrity()
    owner: dict[int, str] = {}  # slot id -> who holds it, to name both sides of a double ownership
    evictable = locked = pinned = 0
    expected_leaves: dict[tuple[int, float, int], TreeNode] = {}
    for salt, root in cache._roots.items():
        assert root.is_root and root.parent is None and root.namespace == salt, (
            f"namespace {salt!r}: its root is not a root node")
        assert root.children, f"namespace {salt!r}: empty root kept (should have been dropped)"
        stack = [root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            _check_children(cache, node, salt)
            if node.is_root:
                continue
            _check_node(cache, node, salt)
            for slot in node.value:
                assert slot not in owner, (
                    f"slot {slot} is owned twice: by {owner[slot]} and by {node!r} (salt {salt!r})")
                assert not allocator.is_free(slot), f"slot {slot} is in the tree ({node!r}) but free"
                owner[slot] = f"{node!r} (salt {salt!r})"
            assert 0 <= node.pin_ref <= node.lock_ref, f"{node!r}: pin_ref {node.pin_ref} > lock_ref {node.lock_ref}"
            if node.lock_ref and node.lock_ref == node.pin_ref:
                pinned += len(node.value)
            if node.lock_ref:
                locked += len(node.value)
            else:
                evictable += len(node.value)
            if not node.children and not node.lock_ref:
                expected_leaves[cache.evict_key(node)] = node
    _check_leaf_index(cache, expected_leaves)
    assert evictable == cache.evictable_size, (
        f"evictable_size is {cache.evictable_size} but the tree holds {evictable} unlocked slots")
    assert locked == cache.locked_size, (
        f"locked_size is {cache.locked_size} but the tree holds {locked} locked slots")
    assert pinned == cache.pinned_size, (
        f"pinned_size is {cache.pinned_size} but pins alone hold {pinned} locked slots")
    num_in_flight = _check_in_flight(cache, in_flight_slots, owner)
    num_free = allocator.num_free_slots
    assert num_free + evictable + locked + num_in_flight == allocator.total_slots, (
        f"accounting: free {num_free} + evictable {evictable} + locked {locked} + in-flight "
        f"{num_in_flight} = {num_free + evictable + locked + num_in_flight} != total {allocator.total_slots}")


def _check_children(cache: RadixCache, node: TreeNode, salt: str | None) -> None:
    child_locks = child_hints = 0
    for child_key, child in node.children.items():
        assert child.parent is node, f"{child!r} (salt {salt!r}) does not point back to its parent"
        assert child_key == cache._child_key(child.key, 0), (
            f"{child!r} (salt {salt!r}) is filed under {child_key!r}, not its first token/page")
        child_locks += child.lock_ref
        child_hints += child.hint_ref
    if not node.is_root:
        assert node.lock_ref >= child_locks, (
            f"{node!r} (salt {salt!r}): lock_ref {node.lock_ref} < children's sum {child_locks}")
        assert node.hint_ref == node.hint_own + child_hints >= 0 <= node.hint_own, (
            f"{node!r} (salt {salt!r}): hint_ref {node.hint_ref} != own {node.hint_own} + children's {child_hints}")


def _check_node(cache: RadixCache, node: TreeNode, salt: str | None) -> None:
    page_size = cache.page_size
    assert node.parent is not None, f"{node!r} is in the tree but marked evicted"
    assert len(node.key) == len(node.value) > 0, (
        f"{node!r} (salt {salt!r}): {len(node.key)} tokens but {len(node.value)} slots")
    assert len(node.key) % page_size == 0, (
        f"{node!r} (salt {salt!r}): {len(node.key)} tokens is not whole pages of {page_size}")
    for start in range(0, len(node.value), page_size):
        first = node.value[start]
        assert first % page_size == 0 and node.value[start:start + page_size] == list(
            range(first, first + page_size)), f"{node!r}: slots {node.value[start:start + page_size]} are not a page"
    assert node.lock_ref >= 0, f"{node!r}: negative lock_ref"
    parent = node.parent
    if not parent.is_root:
        assert parent.last_access >= node.last_access and parent.hit_count >= node.hit_count, (
            f"{node!r} was touched more recently or more often than its parent {parent!r}")


def _check_leaf_index(cache: RadixCache, expected: dict[tuple[int, float, int], TreeNode]) -> None:
    index = cache._evictable_leaves
    assert len(index) == len(expected), (
        f"evictable-leaf index has {len(index)} entries, the tree has {len(expected)} unlocked leaves")
    for key, node in index.items():
        assert expected.get(key) is node, (
            f"evictable-leaf index entry {key} -> {node!r} is stale (wrong priority or not an unlocked leaf)")
        assert node.evict_key == key, f"{node!r} does not know its index key {key}"


def _check_in_flight(cache: RadixCache, in_flight_slots: int | Collection[int], owner: dict[int, str]) -> int:
    if isinstance(in_flight_slots, int):
        return in_flight_slots
    seen: set[int] = set()
    for slot in in_flight_slots:
        assert slot not in seen, f"in-flight slot {slot} is held twice by running requests"
        assert slot not in owner, f"in-flight slot {slot} is also in the tree: {owner[slot]}"
        assert not cache.allocator.is_free(slot), f"in-flight slot {slot} is free in the allocator"
        seen.add(slot)
    return len(seen)
