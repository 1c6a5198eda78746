"""The CPU attention backend's per-step plan, built once by ``step_plan`` before the first layer
and cached in ``meta.step_cache``: own parts ``[own_start, kv_len)`` as query units (a decode; a
block of QUERY_BLOCK queries of a prefill chunk, seeing the keys up to its last query), packed
into a few padded buckets while padding is cheap (PAD_SLACK); and the shared prefixes, one
SharedBatch per nesting level. Each is one call of the reader (native.attend_tokens, or its torch
twin partials.attend_tokens where the kernel is not built): entries of query rows named by token,
each stacked row's key interval [lo, hi), and the entry's K/V slots, read out of the slot table by
device-side ops.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from .base import AttentionMetadata, SharedPrefixPlan
from .metadata import host_tensor

# A bucket pads its units to one shape; it may waste at most this many padded (query, key)
# pairs per unit, about what a separate call's overhead costs (so decodes of different lengths
# share a call, long prefill blocks keep their own).
PAD_SLACK = 2048
QUERY_BLOCK = 256  # a prefill chunk's queries per unit (its causal triangle is cut at this grain)


@dataclass
class Bucket:
    """Units attended in one padded call: [num, max_q] queries over [num, max_k] own keys."""

    num: int
    max_q: int
    max_k: int
    slots: torch.Tensor  # [num, max_k] int64 own keys' slots (padding repeats a valid slot)
    # Stacked row r of unit u sees own keys [lo[u, r], hi[u, r]); int32 [num, max_q * group] (lo None: 0).
    bounds: tuple[torch.Tensor | None, torch.Tensor]
    tokens: torch.Tensor  # int32 [num, max_q] the token (row of q and of the result) of each query, -1 = padding
    padded: bool  # some unit has fewer than max_q queries


@dataclass
class SharedBatch:
    """Shared prefixes read in one call, each merged into the rows below it: entry p
    holds prefix p's queries (``tokens``, -1 = padding to the longest) over its keys (slots padded
    to the longest prefix); ``bounds`` give real rows all of their prefix's keys. No token sits
    below two pieces of one batch (nested prefixes go to successive batches)."""

    tokens: torch.Tensor  # int32 [P, t_max] rows of q below each piece
    slots: torch.Tensor  # [P, max keys] int64 (padding repeats a valid slot)
    bounds: tuple[None, torch.Tensor]  # (lo = 0, hi int32 [P, t_max * group]: the piece's length)


@dataclass
class StepPlan:
    buckets: list[Bucket]  # the own parts: every token sees itself, so they write every result row
    shared_batches: list[SharedBatch]  # the shared prefixes, one call per nesting level, merged in


def step_plan(meta: AttentionMetadata, window: int | None, group: int, use_shared: bool) -> StepPlan:
    key = ("torch_plan", window, group, use_shared)
    if key not in meta.step_cache:
        # Outermost first (merging is order-free; this keeps it fixed).
        shared = sorted(meta.shared, key=lambda p: p.prefix.kv_start) if use_shared else []
        meta.step_cache[key] = StepPlan(_make_buckets(meta, window, group, use_shared),
                                        [_shared_batch(meta, level, group) for level in _levels(shared)])
    return meta.step_cache[key]


def _levels(shared: list[SharedPrefixPlan]) -> list[list[SharedPrefixPlan]]:
    """The prefixes in groups whose query rows are disjoint (so one call may merge them all in
    place): each, outermost first, joins the first group none of whose sequences it shares."""
    levels: list[tuple[set[int], list[SharedPrefixPlan]]] = []
    for plan in shared:
        seqs = set(plan.prefix.seq_idx)
        level = next((lv for lv in levels if lv[0].isdisjoint(seqs)), None)
        if level is None:
            levels.append(level := (set(), []))
        level[0].update(seqs)
        level[1].append(plan)
    return [members for _, members in levels]


def _shared_batch(meta: AttentionMetadata, shared: list[SharedPrefixPlan], group: int) -> SharedBatch:
    """Host lists O(queries below the prefixes + prefixes); the slots come out of the slot table."""
    qo = list(itertools.accumulate(meta.q_lens_list, initial=0))
    below = [[t for i in p.prefix.seq_idx for t in range(qo[i], qo[i + 1])] for p in shared]
    t_max = max(len(rows) for rows in below)
    device, num = meta.slot_table.device, len(shared)
    padded = [t for rows in below for t in itertools.chain(rows, itertools.repeat(-1, t_max - len(rows)))]
    tokens = host_tensor(padded, device, meta.counters, torch.int32).view(num, t_max)
    prefixes = [p.prefix for p in shared]
    lens = [p.num_tokens for p in prefixes]
    ints = host_tensor([meta.rows_list[p.seq_idx[0]] for p in prefixes] + [p.kv_start for p in prefixes] + lens,
                       device, meta.counters).view(3, num, 1)
    row, start, length = ints
    cols = start + torch.minimum(torch.arange(max(lens), device=device)[None, :], length - 1)
    hi = length.to(torch.int32).expand(num, t_max * group).contiguous()  # padding rows are skipped by token
    return SharedBatch(tokens=tokens, slots=meta.slot_table[row, cols], bounds=(None, hi))


def _make_buckets(meta: AttentionMetadata, window: int | None, group: int, use_shared: bool) -> list[Bucket]:
    """Own parts as units of queries (seq, first query, num queries): a decode is one unit; a
    prefill chunk is cut into blocks of QUERY_BLOCK queries, each seeing only the keys up to its
    last query, so the causal upper triangle beyond a block's diagonal is never computed."""
    own = meta.own_starts() if use_shared else [0] * meta.num_seqs
    q_lens, kv_lens = meta.q_lens_list, meta.kv_lens_list
    units: list[tuple[int, int, int]] = []
    for i, n in enumerate(q_lens):
        units.extend((i, off, min(QUERY_BLOCK, n - off)) for off in range(0, n, QUERY_BLOCK))
    k_lens = [kv_lens[i] - q_lens[i] + off + n - own[i] for i, off, n in units]  # keys the unit sees
    unit_q = [n for _, _, n in units]
    decodes = [u for u, (i, _, _) in enumerate(units) if q_lens[i] == 1]
    prefills = [u for u, (i, _, _) in enumerate(units) if q_lens[i] > 1]
    qo = list(itertools.accumulate(q_lens, initial=0))
    buckets = []
    for members in (decodes, prefills):
        for pack in _pack(members, unit_q, k_lens):
            buckets.append(_bucket(meta, [units[u] for u in pack], [k_lens[u] for u in pack], qo, own, window,
                                   group))
    return buckets


def _pack(members: list[int], q_lens: list[int], k_lens: list[int]) -> list[list[int]]:
    """Greedy buckets, largest first, while the padded area exceeds the real one by at most
    PAD_SLACK pairs per unit (running max / sum per bucket: O(units))."""
    order = sorted(members, key=lambda i: (q_lens[i] * k_lens[i], i), reverse=True)
    out: list[list[int]] = []
    mq = mk = real = 0
    for i in order:
        if out:
            n, q, k = len(out[-1]) + 1, max(mq, q_lens[i]), max(mk, k_lens[i])
            area = real + q_lens[i] * k_lens[i]
            if n * q * k - area <= PAD_SLACK * n:
                out[-1].append(i)
                mq, mk, real = q, k, area
                continue
        out.append([i])
        mq, mk, real = q_lens[i], k_lens[i], q_lens[i] * k_lens[i]
    return [sorted(g) for g in out]


def _bucket(meta: AttentionMetadata, units: list[tuple[int, int, int]], k_lens: list[int], qo: list[int],
            own: list[int], window: int | None, group: int) -> Bucket:
    """One padded call over units (seq, first query, num queries) seeing own keys
    [own_start, own_start + k_len) each: each query's token and own-key interval as host lists
    (O(new tokens)), the own keys' slots out of the slot table. Query j of a unit of n queries
    seeing k_len keys sees [lo, k_len - (n - 1 - j)), lo = 0 or the window's first key."""
    num, max_q, max_k = len(units), max(n for _, _, n in units), max(k_lens)
    tok: list[int] = []
    lo: list[int] = []
    hi: list[int] = []
    for (i, off, n), k_len in zip(units, k_lens):
        ends = range(k_len - n + 1, k_len + 1)
        tok.extend(range(qo[i] + off, qo[i] + off + n))
        hi.extend(ends)
        if window is not None:
            lo.extend(max(0, e - window) for e in ends)
        if n < max_q:  # padding: no token, no key
            tok.extend(itertools.repeat(-1, max_q - n))
            hi.extend(itertools.repeat(0, max_q - n))
            lo.extend(itertools.repeat(0, (max_q - n) * (window is not None)))
    device = meta.slot_table.device
    ints = host_tensor(tok + hi + lo, device, meta.counters, torch.int32).view(-1, num, max_q)
    seqs = [i for i, _, _ in units]
    longs = host_tensor([meta.rows_list[i] for i in seqs] + [own[i] for i in seqs] + k_lens, device,
                        meta.counters).view(3, num, 1)
    row, start, k_len = longs
    cols = start + torch.minimum(torch.arange(max_k, device=device)[None, :], k_len - 1)
    per_row = [_per_stacked_row(x, group) for x in ints[1:]]
    return Bucket(num=num, max_q=max_q, max_k=max_k, slots=meta.slot_table[row, cols], tokens=ints[0],
                  bounds=(per_row[1] if window is not None else None, per_row[0]),
                  padded=any(n < max_q for _, _, n in units))


def _per_stacked_row(x: torch.Tensor, group: int) -> torch.Tensor:
    """[num, max_q] -> [num, max_q * group], each value once per GQA head, contiguous (a copy into
    a fresh tensor: repeat_interleave costs ~30 us on the CPU, an expanded view has stride 0)."""
    out = x.new_empty((x.shape[0], x.shape[1] * group))
    out.view(x.shape[0], x.shape[1], group).copy_(x[:, :, None])
    return out
