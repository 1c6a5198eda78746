"""What eviction may take from the radix tree and in which order (ARCHITECTURE §4).

`lock` / `unlock` protect a path (a request's prefix, or a session's pin) and keep the locked / pinned / evictable
sizes. The unlocked leaves are ordered by the policy's priority (LRU, or lru-reuse's hit bonus) within two tiers,
unhinted before hinted: a hint marks a path a waiting request will match (`hint` / `unhint`, counted along the path
like locks, moving to the parent when eviction takes the hinted leaf). `demote` puts a path first in its tier, in the
order of the ranks given: a path nobody will continue (a closed session's), or one whose session is expected back
last. RadixCache inherits this; it keeps the index exact on every change."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from sortedcontainers import SortedDict

    from .radix_cache import TreeNode

EVICTION_POLICIES = ("lru", "lru-reuse")
# One doubling of a node's hit count is worth this many logical clock ticks of recency (lru-reuse).
DEFAULT_REUSE_BONUS = 64.0
DEMOTED = 1 << 40  # a demoted path's last access is its rank less this: before every real stamp (>= 0)


class EvictionOrder:
    eviction_policy: str
    reuse_bonus: float
    _evictable_leaves: SortedDict
    _evictable_size: int
    _locked_size: int
    _pinned_size: int

    def lock(self, node: TreeNode, pin: bool = False) -> None:
        """Protect node and its path to the root from eviction (counted; pair with unlock). A pin is a lock held
        for a session between its requests: the slots only pins hold are counted in `pinned_size`, what dropping
        every pin would make evictable."""
        if node.is_root:
            return
        if node.is_evicted:
            raise ValueError("lock: the node was evicted; match_prefix again and lock the new node")
        deepest = node
        while not node.is_root:
            was_pinned_only = node.lock_ref > 0 and node.lock_ref == node.pin_ref
            if node.lock_ref == 0:
                self._evictable_size -= len(node.value)
                self._locked_size += len(node.value)
            node.lock_ref += 1
            node.pin_ref += int(pin)
            self._pinned_size += len(node.value) * (int(node.lock_ref == node.pin_ref) - int(was_pinned_only))
            node = node.parent
        self._sync_leaf_index(deepest)

    def unlock(self, node: TreeNode, pin: bool = False) -> None:
        if node.is_root:
            return
        # Ancestors' counts are >= the node's, so checking the node makes the whole walk safe.
        if node.lock_ref <= 0 or (pin and node.pin_ref <= 0):
            raise ValueError(f"unlock: {node!r} is not {'pinned' if pin else 'locked'} (unlock without a matching "
                             "lock)")
        deepest = node
        while not node.is_root:
            was_pinned_only = node.lock_ref == node.pin_ref
            node.lock_ref -= 1
            node.pin_ref -= int(pin)
            now_pinned_only = node.lock_ref > 0 and node.lock_ref == node.pin_ref
            self._pinned_size += len(node.value) * (int(now_pinned_only) - int(was_pinned_only))
            if node.lock_ref == 0:
                self._locked_size -= len(node.value)
                self._evictable_size += len(node.value)
            node = node.parent
        self._sync_leaf_index(deepest)

    def hint(self, node: TreeNode) -> None:
        """Mark node's path as expected to be used again (a waiting request will match it): eviction takes every
        unhinted leaf first. Counted; pair with unhint. Unlike a lock it never keeps a slot from being evicted."""
        if node.is_evicted:
            raise ValueError("hint: the node was evicted; match_prefix again and hint the new node")
        self._count_hint(node, +1)

    def unhint(self, node: TreeNode) -> None:
        """Drop a hint. When eviction took the hinted node meanwhile, its hints had moved to its parent (the
        waiting request still matches that much): the hint is dropped there."""
        while node.forward is not None:
            node = node.forward
        if node.is_root or node.is_evicted:
            return  # the whole path went (a hint reaching a root protects nothing)
        if node.hint_own <= 0:
            raise ValueError(f"unhint: {node!r} has no hint (unhint without a matching hint)")
        self._count_hint(node, -1)

    def demote(self, node: TreeNode, rank: int = 0) -> int:
        """Make node, and the ancestors only its path uses, the first candidates of their hint tier (a closed
        session's history: nobody is expected to continue it); among demoted paths, lower `rank` first. Ancestors
        shared with other paths keep their rank, and so does a node with children (a longer path uses it). Returns
        the unlocked slots demoted."""
        if node.children:
            return 0
        stamp = rank - DEMOTED
        slots = 0
        while not node.is_root and node.parent is not None:
            node.last_access, node.hit_count = stamp, 0
            slots += len(node.value) if node.lock_ref == 0 else 0
            self._sync_leaf_index(node)
            node = node.parent
            if node.is_root or len(node.children) > 1:
                break
        return slots

    def candidates(self) -> Iterator[TreeNode]:
        """The unlocked leaves in the order eviction takes them (a parent joins once its last child is gone)."""
        return iter(self._evictable_leaves.values())

    def _count_hint(self, node: TreeNode, delta: int) -> None:
        if node.is_root:
            return
        node.hint_own += delta
        deepest = node
        while not node.is_root:
            node.hint_ref += delta
            node = node.parent
        self._sync_leaf_index(deepest)

    def _priority(self, node: TreeNode) -> float:
        """Lower is evicted first.

        lru: the logical time of the last access.
        lru-reuse: last access + reuse_bonus * log2(1 + hit_count). A prefix that has been hit h times
        is treated as if it had been used reuse_bonus * log2(1 + h) ticks later than it was: reuse
        buys extra lifetime, with diminishing returns so a once-hot prefix still ages out (each
        doubling of hits adds a fixed amount of time rather than an unbounded frequency count).
        """
        if self.eviction_policy == "lru":
            return float(node.last_access)
        return node.last_access + self.reuse_bonus * math.log2(1 + node.hit_count)

    def evict_key(self, node: TreeNode) -> tuple[int, float, int]:
        """A leaf's place in the eviction order: unhinted before hinted, then priority, then age."""
        return (int(node.hint_ref > 0), self._priority(node), node.node_id)

    def _sync_leaf_index(self, node: TreeNode) -> None:
        """Make the evictable-leaf index exact for node: present (with its current priority) iff it
        is an unlocked, attached, non-root leaf."""
        if node.evict_key is not None:
            del self._evictable_leaves[node.evict_key]
            node.evict_key = None
        if not node.children and node.lock_ref == 0 and not node.is_root and node.parent is not None:
            node.evict_key = self.evict_key(node)
            self._evictable_leaves[node.evict_key] = node
