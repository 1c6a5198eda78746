"""Batches with shared prefixes for the cascade-attention tests (torch and Triton backends).

A batch is built from a tree of shared prefixes: the members of a SharedPrefix really hold the
same slots for its positions, every other position has slots of its own, and slots nobody owns
hold NaN, so a read outside a range fails loudly.

    groups  [([0, 1, 2], 21), ([0, 1], 5)]      own_cached [0, 3, 2], q_lens [4, 1, 1]
    seq 0:  | shared 0 (21) | shared 1 (5) | own: 4 new            |
    seq 1:  | shared 0 (21) | shared 1 (5) | own: 3 cached + 1 new |
    seq 2:  | shared 0 (21) | own: 2 cached + 1 new |

Segments (each group's positions, then each sequence's own positions) get whole pages of the
pool. ``layout=None`` puts every segment on pages scattered over a shuffled pool (page 0 kept
for the reference's padding); otherwise ``layout[k]`` says how segment k is placed: "run"
(consecutive pages, so its slots are one contiguous range: the view paths) or "scatter" (pages
in random order anywhere: the gather paths).
"""
from __future__ import annotations

import math
import random

import torch
from hypothesis import strategies as st

from radixserve.kernels.attention import torch_ref
from radixserve.kernels.attention.base import SharedPrefix
from radixserve.kernels.attention.metadata import meta_from_slot_lists


def shared_layout(own_cached, q_lens, groups):
    """(shared, prefix_lens, segments): the SharedPrefix list, each seq's cached length, and the
    segments [(members, length)] in placement order (groups first, then each seq's own part)."""
    num = len(q_lens)
    own = [0] * num
    shared, segments = [], []
    for members, length in groups:
        start = own[members[0]]
        assert all(own[m] == start for m in members), "members of a group must share their earlier ranges"
        shared.append(SharedPrefix(start, start + length, sorted(members)))
        segments.append((sorted(members), length))
        for m in members:
            own[m] = start + length
    prefix_lens = [o + c for o, c in zip(own, own_cached)]
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    segments += [([i], kv_lens[i] - own[i]) for i in range(num)]  # each seq's own positions, last
    return shared, prefix_lens, segments


PREFIX_LENS = st.integers(1, 24)
Q_LENS = st.one_of(st.just(1), st.integers(2, 7))
OWN_CACHED = st.integers(0, 6)
DEPTHS = st.integers(1, 3)


@st.composite
def shared_trees(draw, lengths=PREFIX_LENS, q_lens=Q_LENS, own_cached=OWN_CACHED, depths=DEPTHS, max_seqs=5):
    """(own_cached, q_lens, groups) for make_shared_batch: 2..max_seqs sequences and a tree of shared
    prefixes over them, ``depths`` levels deep (0: nothing shared); each level splits every group
    of the level above into sibling subgroups of >= 2 members."""
    num = draw(st.integers(2, max_seqs))
    q_len_list = draw(st.lists(q_lens, min_size=num, max_size=num))
    own_list = draw(st.lists(own_cached, min_size=num, max_size=num))
    groups, frontier = [], [list(range(num))]
    for _ in range(draw(depths)):
        next_frontier = []
        for members in frontier:
            rest = list(members)
            while len(rest) >= 2:  # split the group into sibling subgroups of >= 2 members
                sub = sorted(draw(st.permutations(rest))[:draw(st.integers(2, len(rest)))])
                groups.append((sub, draw(lengths)))
                next_frontier.append(sub)
                rest = [m for m in rest if m not in sub]
                if not draw(st.booleans()):
                    break
        frontier = next_frontier
    return own_list, q_len_list, groups


def make_shared_batch(own_cached, q_lens, groups, *, group, num_kv_heads, head_dim, dtype, page_size=16, seed=0,
                      device="cpu", layout=None, shared=None):
    """groups: [(members, length)], a parent before its children; a group's range starts where
    its members' previous ranges end. own_cached[i]: cached positions of seq i past its shared
    ranges. ``shared`` overrides the SharedPrefix list handed to the metadata (mutation tests).
    Returns (meta, k_cache, v_cache, q) with the new tokens' K/V already stored."""
    real_shared, prefix_lens, segments = shared_layout(own_cached, q_lens, groups)
    num = len(q_lens)
    gen = torch.Generator().manual_seed(seed)
    seg_pages = [math.ceil(n / page_size) for _, n in segments]
    if layout is None:
        num_pages = 1 + sum(seg_pages) + 2  # page 0: the reference's padding
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        placed, next_page = [], 0
        for n in seg_pages:
            placed.append(order[next_page:next_page + n])
            next_page += n
    else:
        assert len(layout) == len(segments), f"layout needs {len(segments)} entries (groups, then own parts)"
        num_pages, placed = _place(seg_pages, layout, random.Random(seed))
    slot_lists = [[] for _ in range(num)]
    for (members, length), pages in zip(segments, placed):
        slots = [pages[j // page_size] * page_size + j % page_size for j in range(length)]
        for m in members:
            slot_lists[m].extend(slots)

    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    cached = {s for sl, p in zip(slot_lists, prefix_lens) for s in sl[:p]}
    if layout is None:
        cached |= set(range(page_size))
    cached = sorted(cached)
    k_cache[cached] = torch.randn((len(cached), num_kv_heads, head_dim), generator=gen).to(dtype)
    v_cache[cached] = torch.randn((len(cached), num_kv_heads, head_dim), generator=gen).to(dtype)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    meta = meta_from_slot_lists(prefix_lens, q_lens, slot_lists, device,
                                shared=real_shared if shared is None else shared)
    num_tokens = sum(q_lens)
    k_new, v_new = (torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(device, dtype)
                    for _ in range(2))
    torch_ref.store_kv(k_cache, v_cache, k_new, v_new, meta.out_slot_ids)
    q = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen).to(device, dtype)
    return meta, k_cache, v_cache, q


def _place(seg_pages: list[int], layout: list[str], rng: random.Random) -> tuple[int, list[list[int]]]:
    """Pages for each segment in a pool with room to spare; page 0 is never handed out (the slot
    table's padding points there, so it stays NaN)."""
    num_pages = 1 + 2 * sum(seg_pages) + 4
    is_free = [False] + [True] * (num_pages - 1)
    placed = []
    for n, how in zip(seg_pages, layout):
        assert how in ("run", "scatter"), how
        pages = None
        if how == "run":
            starts, run = [], 0  # starts of n free pages in a row
            for p in range(num_pages):
                run = run + 1 if is_free[p] else 0
                if run >= n:
                    starts.append(p - n + 1)
            if starts:
                first = rng.choice(starts)
                pages = list(range(first, first + n))
        if pages is None:
            pages = rng.sample([p for p in range(num_pages) if is_free[p]], n)
        for p in pages:
            is_free[p] = False
        placed.append(pages)
    return num_pages, placed
