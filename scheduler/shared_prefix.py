"""The forest of radix nodes that several requests of one batch share (ARCHITECTURE §7).

Every request of a batch holds a lock on the last radix node of its cached prefix, and its
KV slots for the positions on that node's path *are* the tree's slots. So requests below one
node read the same keys and values there; attention can read them once for all of them. This
module turns the batch's locked nodes into key ranges for the runner (pure Python, O(batch x
path length in nodes), nothing per token):

    tree (counts = batch requests below)         ranges handed to the runner
    root ── A [0, 900) 64 ──┬── B [900, 1000) 8   A: [0, 900) for all 64
                            │     └── ...         B: [900, 1000) for those 8
                            └── C [900, 910) 2    C: too short alone (min 32) -> not used;
                                                     its 2 requests read [900, 910) as their own

A chain of nodes with the same requests below is one range. A range shorter than
``min_tokens`` is not used on its own but its keys stay uncovered, so the next used range
below it starts where the last used one ended; a request's own keys start after its deepest
used range. Ranges only ever cover whole tree nodes, so they lie inside every member's cached
prefix (``tree_len <= kv_len``), which is what the runner checks.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..kernels.attention.base import SharedPrefix


def order_and_share(nodes: Sequence[Any], min_tokens: int) -> tuple[list[int], list[SharedPrefix]]:
    """Both at once, walking each path once: the batch order of ``order_by_prefix`` and the
    shared ranges of the batch in that order (``seq_idx`` index the reordered batch)."""
    paths = _root_paths(nodes)
    order = _order(paths)
    return order, _ranges([paths[i] for i in order], min_tokens)


def order_by_prefix(nodes: Sequence[Any]) -> list[int]:
    """Batch indices sorted so that requests below one node are adjacent (then each shared
    range's queries are one run of rows)."""
    return _order(_root_paths(nodes))


def shared_prefixes(nodes: Sequence[Any], min_tokens: int) -> list[SharedPrefix]:
    """Ranges of keys shared by >= 2 of the batch's requests; ``nodes[i]`` is request i's locked
    radix node (a root or None when it has no cached prefix)."""
    return _ranges(_root_paths(nodes), min_tokens)


def _root_paths(nodes: Sequence[Any]) -> list[list[Any]]:
    return [list(reversed(_path(node))) for node in nodes]  # root-side first


def _order(paths: list[list[Any]]) -> list[int]:
    keys = [tuple(n.node_id for n in path) for path in paths]
    return sorted(range(len(paths)), key=lambda i: (keys[i], i))


def _ranges(paths: list[list[Any]], min_tokens: int) -> list[SharedPrefix]:
    members: dict[int, list[int]] = {}
    for i, path in enumerate(paths):
        for n in path:
            members.setdefault(id(n), []).append(i)
    used: dict[int, SharedPrefix] = {}  # id(last node of a used range) -> range
    for path in paths:
        covered = 0  # end of the deepest used range on this path
        end = 0  # key positions covered by the path so far
        for depth, n in enumerate(path):
            end += len(n.key)
            below = members[id(n)]
            if len(below) < 2:
                break
            child = path[depth + 1] if depth + 1 < len(path) else None
            if child is not None and len(members[id(child)]) == len(below):
                continue  # same requests below: the range goes on into the child
            if end - covered >= max(min_tokens, 1):
                used.setdefault(id(n), SharedPrefix(covered, end, below))
                covered = end
    return sorted(used.values(), key=lambda p: (p.kv_start, p.seq_idx))


def _path(node: Any) -> list[Any]:
    """Nodes from ``node`` up to (not including) its root."""
    out = []
    while node is not None and not node.is_root and node.parent is not None:
        out.append(node)
        node = node.parent
    return out
