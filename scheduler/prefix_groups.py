"""The tree of waiting prompts that the cache-aware policies walk (pure Python, no torch).

Prompts are compared as tuples of chained block hashes (`block_size` tokens per block), so
sorting them groups shared prefixes next to each other at C speed; the longest common prefix of
neighbours in that order spells out the tree (the same construction that turns a suffix array and
its LCP array into a suffix tree). Shared lengths are whole blocks: a shared prefix is seen to within
block_size - 1 tokens, which is all a scheduling decision needs.

    sorted keys        lcp with previous      tree
    A = (s, b1, b2)          -                root
    B = (s, b1, b2, b7)      3                 └─ (s, b1, b2) ── A ends here
    C = (s, b1, b9)          2                     ├─ b7: B
                                                   └─ ... C splits at depth 2

"Claims" are running requests still prefilling: they take part in the tree so that waiting
requests sharing their uncached prefix can be deferred until it is cached, but are never emitted.
"""
from __future__ import annotations

from typing import Callable, Sequence


def block_key(token_ids: Sequence[int], salt: str | None, block_size: int) -> tuple:
    """Sort key of a prompt: its salt namespace, then one chained hash per block of tokens (each
    covers the header and every block before it, so two keys agree at a position iff they agree
    up to it: the common prefix of two keys is found by a binary search on single elements)."""
    head: tuple = (0,) if salt is None else (1, salt)
    chain = hash(head)
    blocks = []
    for i in range(0, len(token_ids), block_size):
        chain = hash((chain, tuple(token_ids[i:i + block_size])))
        blocks.append(chain)
    return head + tuple(blocks)


class _Node:
    __slots__ = ("depth", "children", "members", "claims", "weight", "has_claim", "first", "min_len",
                 "head_len")

    def __init__(self, depth: int) -> None:
        self.depth = depth  # key elements shared by everything below
        self.children: list[_Node] = []
        self.members: list[int] = []  # waiting requests whose key ends here (window indices)
        self.claims = 0  # claims whose key ends here
        self.weight = 0  # waiting requests in the subtree
        self.has_claim = False
        self.first = 1 << 62  # smallest window index (earliest arrival) in the subtree
        self.min_len = 1 << 62  # shortest prompt in the subtree (caps the shared token count)
        self.head_len = 0  # salt-header length of the keys below (1 or 2)


class PrefixGroups:
    """Tree over the keys of waiting requests (window order = arrival order) and claims."""

    def __init__(self, keys: list[tuple], lengths: list[int], claim_keys: list[tuple],
                 claim_lengths: list[int], block_size: int) -> None:
        self.block_size = block_size
        self.num_waiting = len(keys)
        all_keys = keys + claim_keys
        all_lengths = lengths + claim_lengths
        order = sorted(range(len(all_keys)), key=all_keys.__getitem__)  # stable: ties keep arrival order
        self.root = _Node(0)
        self.nodes: list[_Node] = [self.root]
        self._build(order, all_keys, all_lengths)

    def shared_tokens(self, node: _Node) -> int:
        return max(0, min((node.depth - node.head_len) * self.block_size, node.min_len))

    def cached_per_node(self, cached_len: Callable[[int], int]) -> dict[int, int]:
        """Cached tokens of each node's shared prefix, from one waiting request below it.

        cached_len(i) is called at most once per waiting request.
        """
        memo: dict[int, int] = {}

        def cached_of(idx: int) -> int:
            if idx not in memo:
                memo[idx] = cached_len(idx)
            return memo[idx]

        out: dict[int, int] = {}
        for node in self.nodes:
            if node.weight > 0:
                out[id(node)] = min(cached_of(node.first), self.shared_tokens(node))
        return out

    def dfs_order(self, cached: dict[int, int] | None, dedup_min_tokens: int | None) -> list[int]:
        """Window indices in walk order.

        cached None: dfs-weight (children by waiting count, then arrival). Otherwise children by
        cached tokens x waiting count, then count, then arrival; and with dedup_min_tokens set, a
        subtree whose shared prefix has at least that many uncached tokens and two or more
        requests (or a claim) yields only its first request (none if a claim computes it).
        """
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and dedup_min_tokens is not None and cached is not None:
                # A prompt's last token is never matched (its logits are needed): identical prompts (the n choices
                # of one) share all but that, and wait for nobody once the rest is cached.
                shareable = min(self.shared_tokens(node), node.min_len - 1)
                uncached = shareable - cached.get(id(node), 0)
                if node.weight + int(node.has_claim) >= 2 and uncached >= max(dedup_min_tokens, 1):
                    if not node.has_claim:
                        out.append(self._leader(node, cached))
                    continue
            out.extend(node.members)
            stack.extend(reversed(self._ranked_children(node, cached)))
        return out

    # -- helpers ------------------------------------------------------------------------

    def _ranked_children(self, node: _Node, cached: dict[int, int] | None) -> list[_Node]:
        live = [c for c in node.children if c.weight > 0]
        if cached is None:
            live.sort(key=lambda c: (-c.weight, c.first))
        else:
            live.sort(key=lambda c: (-cached.get(id(c), 0) * c.weight, -c.weight, c.first))
        return live

    def _leader(self, node: _Node, cached: dict[int, int]) -> int:
        """The first request the walk would reach below node."""
        while not node.members:
            node = self._ranked_children(node, cached)[0]
        return node.members[0]

    def _build(self, order: list[int], keys: list[tuple], lengths: list[int]) -> None:
        stack = [self.root]
        prev: tuple | None = None
        for idx in order:
            key = keys[idx]
            lcp = _lcp(prev, key) if prev is not None else 0
            last: _Node | None = None
            while stack[-1].depth > lcp:
                last = stack.pop()
            if stack[-1].depth < lcp:
                # Split: a new inner node at depth lcp takes over `last` (the previous branch).
                mid = _Node(lcp)
                parent = stack[-1]
                parent.children[-1] = mid  # `last` was the most recent child of parent
                mid.children.append(last)
                self.nodes.append(mid)
                stack.append(mid)
            if len(key) > stack[-1].depth:
                leaf = _Node(len(key))
                stack[-1].children.append(leaf)
                self.nodes.append(leaf)
                stack.append(leaf)
            end = stack[-1]
            if idx < self.num_waiting:
                end.members.append(idx)
            else:
                end.claims += 1
            end.head_len = 1 if key[0] == 0 else 2
            end.min_len = min(end.min_len, lengths[idx])
            prev = key
        self._aggregate()

    def _aggregate(self) -> None:
        # self.nodes lists parents before their children except for split nodes; a post-order
        # walk from the root is simplest and exact.
        post: list[_Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            post.append(node)
            stack.extend(node.children)
        for node in reversed(post):
            node.weight = len(node.members)
            node.has_claim = node.claims > 0
            node.first = min(node.members) if node.members else 1 << 62
            for child in node.children:
                node.weight += child.weight
                node.has_claim = node.has_claim or child.has_claim
                if child.weight > 0:
                    node.first = min(node.first, child.first)
                node.min_len = min(node.min_len, child.min_len)
                node.head_len = node.head_len or child.head_len


def _lcp(a: tuple, b: tuple) -> int:
    """Common prefix length of two block keys: a[i] == b[i] holds exactly for i < the answer."""
    num = min(len(a), len(b))
    if num == 0 or a[num - 1] == b[num - 1]:
        return num
    lo, hi = 0, num - 1  # a[:lo] == b[:lo]; a[hi] != b[hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
