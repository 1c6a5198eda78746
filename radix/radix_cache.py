"""Radix tree over token ids whose values are KV slot ids: the RadixAttention prefix cache.

Layout: one tree per salt namespace (requests with different `cache_salt` never share a node).
An edge holds a run of tokens (`key`) and, position for position, the KV slots (`value`) that hold
their keys/values. Children are keyed by their first token (page_size 1) or first page tuple.

    root ── [1 2 3 4] ──┬── [5 6]          the path root..node spells a cached prefix;
                        └── [7 8 9]        slots of a prefix = concatenated values on its path

Invariants (checked by check_integrity):
- lock_ref(node) = locks taken on the node itself + sum of lock_ref of its children, so a locked node's
  whole path to the root is locked and eviction (leaves only) can never reach it.
- hint_ref(node) likewise counts hints (expected uses: a waiting request will match the path) on the node and below.
- The evictable-leaf index holds exactly the unlocked leaves, keyed by (hinted, priority, node_id): a hinted
  leaf goes only when no unhinted one is left (a preference, never a ban).
- A parent's last_access and hit_count are >= its descendants' (every touch stamps the whole path),
  so a parent never outranks its own leaves for eviction.
- free + evictable + locked + in-flight == total slots.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from sortedcontainers import SortedDict

from ._integrity import check_cache_integrity
from .allocator import KVAllocator
from .eviction_order import DEFAULT_REUSE_BONUS, EVICTION_POLICIES, EvictionOrder

logger = logging.getLogger(__name__)



class TreeNode:
    """One edge of the tree: `key` token ids and the KV `value` slot ids that back them."""

    __slots__ = (
        "key", "value", "children", "parent", "lock_ref", "pin_ref", "hint_ref", "hint_own", "forward",
        "last_access", "hit_count",
        "node_id", "evict_key", "is_root", "namespace",
    )

    def __init__(self, key: tuple[int, ...], value: list[int], parent: TreeNode | None,
                 node_id: int, is_root: bool = False) -> None:
        self.key = key
        self.value = value
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent  # None for a root and for an evicted (detached) node
        self.lock_ref = 0
        self.pin_ref = 0  # those of lock_ref that are pins (lock(pin=True)): held for a session, not a request
        self.hint_ref = 0  # expected uses (hint): on the node itself + its children's, like lock_ref
        self.hint_own = 0  # those of hint_ref placed on this node itself
        self.forward: TreeNode | None = None  # once evicted: the parent its own hints moved to
        self.last_access = 0  # logical clock of the last match/insert touching this node
        self.hit_count = 0  # number of match_prefix calls whose match covered this node
        self.node_id = node_id  # creation order; breaks priority ties deterministically
        self.evict_key: tuple[int, float, int] | None = None  # set while in the evictable-leaf index
        self.is_root = is_root
        self.namespace: str | None = None  # the salt, on roots only

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_evicted(self) -> bool:
        return self.parent is None and not self.is_root

    def __repr__(self) -> str:
        if self.is_root:
            return f"TreeNode(root, salt={self.namespace!r}, children={len(self.children)})"
        return (f"TreeNode(id={self.node_id}, num_tokens={len(self.key)}, lock_ref={self.lock_ref}, "
                f"last_access={self.last_access}, hit_count={self.hit_count})")


# Where a match stopped: the last node it covered whole and that node's depth (RadixCache.match_cursor).
MatchCursor = tuple[TreeNode, int]


class RadixCache(EvictionOrder):
    """Prefix cache over a KVAllocator; see ARCHITECTURE.md §4 for the contract."""

    def __init__(self, allocator: KVAllocator, page_size: int = 1, disable: bool = False,
                 eviction_policy: str = "lru-reuse",
                 reuse_bonus: float = DEFAULT_REUSE_BONUS) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size ({page_size}) must equal the allocator's page_size ({allocator.page_size})")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}")
        if not reuse_bonus >= 0:
            raise ValueError(f"reuse_bonus must be >= 0, got {reuse_bonus}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self.reuse_bonus = float(reuse_bonus)
        self.num_evicted_tokens = 0
        self._roots: dict[str | None, TreeNode] = {}
        # Unlocked leaves ordered by eviction priority, kept up to date on every change (never rebuilt).
        self._evictable_leaves: SortedDict = SortedDict()
        self._clock = 0  # logical time: one tick per recorded match / insert, so runs are reproducible
        # Bumped whenever the set of cached prefixes changes (insert of new tokens, evict, reset), so
        # a match length computed at one epoch holds until the next (policies memoise on it).
        self.epoch = 0
        self._num_nodes_created = 0
        self._evictable_size = 0
        self._locked_size = 0
        self._pinned_size = 0

    # ------------------------------------------------------------------ public API

    def match_prefix(self, tokens: Sequence[int], salt: str | None = None, *,
                     record_hit: bool = True) -> tuple[list[int], TreeNode]:
        """Slot ids of the longest cached prefix of `tokens` (whole pages only) and its last node.

        Splits an edge when the match ends inside it, so the returned node covers exactly the match
        and can be locked. Stamps access time and hit counts on the matched path unless
        `record_hit` is False (bookkeeping matches that are not a request's use of the prefix).
        Returns the namespace root when nothing matches (locking a root is a no-op).
        """
        root = self._root(salt, create=False)
        if self.disable:
            return [], root
        key = self._whole_pages(tokens)
        slot_ids, node, _ = self._walk(root, key, split=True)
        if record_hit:
            self.record_hit(node)
        return slot_ids, node

    def record_hit(self, node: TreeNode) -> None:
        """A request's use of the prefix that ends at `node` (matched earlier with record_hit=False): stamps the
        path's access time and hit counts, as match_prefix does."""
        if not node.is_root:
            self._clock += 1
            self._touch(node, hit=True)

    def peek_prefix(self, tokens: Sequence[int], salt: str | None = None) -> list[int]:
        """Like match_prefix but read-only: no split, no access stamp (for scheduling policies)."""
        if self.disable or salt not in self._roots:
            return []
        slot_ids, _, _ = self._walk(self._roots[salt], self._whole_pages(tokens), split=False)
        return slot_ids

    def match_length(self, tokens: Sequence[int], salt: str | None = None, limit: int | None = None) -> int:
        """len(peek_prefix(tokens[:limit], salt)), building no slot list and copying only the tokens
        compared. Read-only (no split, no access stamp); constant while `epoch` stays."""
        return self.match_cursor(tokens, salt, limit)[0]

    def match_cursor(self, tokens: Sequence[int], salt: str | None = None, limit: int | None = None,
                     cursor: MatchCursor | None = None) -> tuple[int, MatchCursor | None]:
        """match_length, resumable across changes to the tree: also returns a cursor (the last node the match
        covered whole, and its depth) which, passed back with the same tokens, salt and limit after any inserts,
        splits or evictions, resumes the walk from that node if it is still cached. A node's depth never changes
        (a split keeps the lower part's object) and an evicted node is detached, so an attached cursor node means
        the whole path above it is still cached. A waiting request re-measured every step costs one child lookup
        instead of a walk over its whole prompt (scheduler/policy.py cached_len)."""
        root = self._roots.get(salt)
        if self.disable or root is None:
            return 0, None
        end = len(tokens) if limit is None else max(min(limit, len(tokens)), 0)
        end -= end % self.page_size
        node, pos = root, 0
        if cursor is not None and cursor[1] <= end and self._attached(cursor[0], root):
            node, pos = cursor
        while pos < end:
            first = tokens[pos] if self.page_size == 1 else tuple(tokens[pos:pos + self.page_size])
            child = node.children.get(first)
            if child is None:
                return pos, (node, pos)
            num = self._common_len(child.key, tuple(tokens[pos:pos + min(len(child.key), end - pos)]), 0)
            if num < len(child.key):
                return pos + num, (node, pos)
            pos += num
            node = child
        return pos, (node, pos)

    @staticmethod
    def _attached(node: TreeNode, root: TreeNode) -> bool:
        """Whether `node` is still in the tree under `root` (an evicted or reset node is detached; a namespace root
        dropped with its last child is replaced by a new one)."""
        return node is root if node.is_root else node.parent is not None

    def insert(self, tokens: Sequence[int], slot_ids: Sequence[int], salt: str | None = None) -> int:
        """Cache `tokens` backed by `slot_ids`; returns how many leading tokens were already cached.

        The tree takes ownership of slot_ids[returned:]. For slot_ids[:returned] the tree keeps its
        own slots: the caller frees those of its slots in that range that it allocated itself
        (not the ones it got from match_prefix). With disable=True nothing is inserted, 0 is
        returned, and the caller keeps (and must free) all of its slots.
        """
        return self.insert_path(tokens, slot_ids, salt)[0]

    def insert_path(self, tokens: Sequence[int], slot_ids: Sequence[int],
                    salt: str | None = None) -> tuple[int, list[int], TreeNode]:
        """`insert`, returning also what a request that goes on using the path needs, from the same walk:
        (tokens already cached, the tree's slots for them, the node that ends at len(tokens), to lock).
        The path's slots are the returned ones followed by slot_ids[num_cached:]."""
        if len(tokens) != len(slot_ids):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slot_ids)} slot ids")
        if len(tokens) % self.page_size != 0:
            raise ValueError(
                f"insert: {len(tokens)} tokens is not a whole number of pages of {self.page_size}")
        if self.disable or len(tokens) == 0:
            return 0, [], self._root(salt, create=False)
        self._clock += 1
        key = tuple(tokens)
        cached, node, num_cached = self._walk(self._root(salt, create=True), key, split=True)
        if num_cached < len(key):
            node = self._add_leaf(node, key[num_cached:], list(slot_ids[num_cached:]))
            self.epoch += 1
        self._touch(node, hit=False)
        return num_cached, cached, node

    def evict(self, num_tokens: int) -> int:
        """Free num_tokens slots (rounded up to whole pages) if that many are evictable: unlocked leaves, least
        valuable first; a parent joins the candidates once its last child is gone. Of the last leaf it needs, only
        the tail goes: its head stays cached for a partial match, as a token-level cache would keep it (taking
        whole leaves freed a third more than asked on bench/agent_replay's trace, history that was hit later)."""
        leaves = self._evictable_leaves
        freed_slot_ids: list[int] = []
        while len(freed_slot_ids) < num_tokens and leaves:
            leaf = leaves.peekitem(0)[1]
            tail = -(-(num_tokens - len(freed_slot_ids)) // self.page_size) * self.page_size
            if tail < len(leaf.value):
                self._split(leaf, len(leaf.value) - tail)  # the leaf object keeps the tail, which goes
            _, leaf = leaves.popitem(0)
            leaf.evict_key = None
            freed_slot_ids.extend(leaf.value)
            self._evictable_size -= len(leaf.value)
            parent = leaf.parent
            if leaf.hint_own:  # its hints move to the parent (the path's counts above stay as they are)
                leaf.forward = parent  # a root keeps no counts: the hint ends there
                if not parent.is_root:
                    parent.hint_own += leaf.hint_own
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None
            leaf.value = []
            if not parent.is_root:
                self._sync_leaf_index(parent)
            elif not parent.children:
                del self._roots[parent.namespace]  # an empty namespace costs nothing to recreate
        if freed_slot_ids:
            self.epoch += 1
            self.allocator.free(freed_slot_ids)
            self.num_evicted_tokens += len(freed_slot_ids)
            logger.debug("evicted %d slots (asked for %d)", len(freed_slot_ids), num_tokens)
        return len(freed_slot_ids)

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def locked_size(self) -> int:
        return self._locked_size

    @property
    def pinned_size(self) -> int:
        """Locked slots that only pins hold (a subset of locked_size)."""
        return self._pinned_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._locked_size

    def reset(self) -> None:
        """Drop every cached prefix and free its slots. Nothing may be locked."""
        if self._locked_size:
            raise ValueError(f"reset: {self._locked_size} cached slots are still locked by requests")
        slot_ids: list[int] = []
        for node in self._iter_nodes():
            slot_ids.extend(node.value)
            node.parent = None
            node.evict_key = None
        self._roots.clear()
        self.epoch += 1
        self._evictable_leaves.clear()
        self._evictable_size = 0
        if slot_ids:
            self.allocator.free(slot_ids)

    def all_slot_ids(self) -> list[int]:
        slot_ids: list[int] = []
        for node in self._iter_nodes():
            slot_ids.extend(node.value)
        return slot_ids

    def check_integrity(self, in_flight_slots: int | Collection[int] = 0) -> None:
        """Assert the invariants in the module docstring with messages that name what broke.

        `in_flight_slots` is the number of slots held by running requests outside the tree, or the
        slot ids themselves (then each must be allocated and not in the tree).
        """
        check_cache_integrity(self, in_flight_slots)

    def __repr__(self) -> str:
        return (f"RadixCache(page_size={self.page_size}, policy={self.eviction_policy!r}, "
                f"evictable={self._evictable_size}, locked={self._locked_size}, "
                f"namespaces={len(self._roots)})")

    # ------------------------------------------------------------------ helpers

    def _root(self, salt: str | None, create: bool) -> TreeNode:
        root = self._roots.get(salt)
        if root is None:
            root = TreeNode((), [], None, -1, is_root=True)
            root.namespace = salt
            if create:
                self._roots[salt] = root
        return root

    def _whole_pages(self, tokens: Sequence[int]) -> tuple[int, ...]:
        num_tokens = len(tokens) - len(tokens) % self.page_size
        return tuple(tokens[:num_tokens])

    def _child_key(self, key: tuple[int, ...], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else key[pos:pos + self.page_size]

    def _walk(self, node: TreeNode, key: tuple[int, ...], split: bool) -> tuple[list[int], TreeNode, int]:
        """Follow `key` down from `node`: (matched slot ids, last node covering them, match length).

        With split=False a match ending inside an edge still reports its slots, but the returned
        node is the last one fully matched.
        """
        slot_ids: list[int] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            num_common = self._common_len(child.key, key, pos)
            pos += num_common
            if num_common < len(child.key):
                if split:
                    node = self._split(child, num_common)
                    slot_ids.extend(node.value)
                else:
                    slot_ids.extend(child.value[:num_common])
                break
            slot_ids.extend(child.value)
            node = child
        return slot_ids, node, pos

    def _common_len(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Length of the common prefix of edge and key[pos:], in whole pages. The first token/page
        is known to match (it selected the child)."""
        num_cmp = min(len(edge), len(key) - pos)
        if edge[:num_cmp] == key[pos:pos + num_cmp]:  # C-speed fast path: the usual full match
            return num_cmp
        page = self.page_size
        lo, hi = page, num_cmp  # edge[:lo] matches, edge[:hi] does not: bisect in whole pages
        while hi - lo > page:
            mid = lo + (hi - lo) // (2 * page) * page
            if edge[lo:mid] == key[pos + lo:pos + mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def _split(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut node's edge after split_len tokens; returns the new upper node. The lower part keeps
        the original object so references held by requests (and their locks) stay valid."""
        parent = node.parent
        self._num_nodes_created += 1
        upper = TreeNode(node.key[:split_len], node.value[:split_len], parent, self._num_nodes_created)
        upper.lock_ref = node.lock_ref
        upper.pin_ref = node.pin_ref
        upper.hint_ref = node.hint_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        node.key = node.key[split_len:]
        node.value = node.value[split_len:]
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        parent.children[self._child_key(upper.key, 0)] = upper
        # Sizes and the lower node's priority are unchanged; upper has a child so is not indexed.
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], value: list[int]) -> TreeNode:
        if self.page_size > 1:
            _check_whole_pages(value, self.page_size)
        self._num_nodes_created += 1
        leaf = TreeNode(key, value, parent, self._num_nodes_created)
        parent.children[self._child_key(key, 0)] = leaf
        self._evictable_size += len(value)
        if not parent.is_root:
            self._sync_leaf_index(parent)  # it has a child now
        return leaf

    def _touch(self, node: TreeNode, hit: bool) -> None:
        """Stamp node..root with the current clock (and a hit). Only `node` can be a leaf."""
        deepest = node
        while not node.is_root:
            node.last_access = self._clock
            if hit:
                node.hit_count += 1
            node = node.parent
        self._sync_leaf_index(deepest)

    def _iter_nodes(self):
        """Every non-root node of every namespace (parents before children)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.is_root:
                yield node


def _check_whole_pages(slot_ids: list[int], page_size: int) -> None:
    for start in range(0, len(slot_ids), page_size):
        first = slot_ids[start]
        if first % page_size != 0 or slot_ids[start:start + page_size] != list(range(first, first + page_size)):
            raise ValueError(
                f"insert: slot ids {slot_ids[start:start + page_size]} are not one whole page of "
                f"{page_size} consecutive slots starting at a multiple of {page_size}")
