"""The CPU attention backend's per-step plan, built once by ``step_plan`` before the first layer
and cached in ``meta.step_cache``: own parts ``[own_start, kv_len)`` as query units (a decode; a
block of QUERY_BLOCK queries of a prefill chunk, seeing the keys up to its last query), packed
into a few padded buckets while padding is cheap (PAD_SLACK), with K/V slot indices read out of
the slot table by device-side ops; and the shared prefixes, outermost first: one piece each for
torch's flash op, one SharedBatch per nesting level for the native kernel.

What a row sees is said two ways, for the two kernels that read it: the native kernel
(native.py) takes each stacked query row's key interval [lo, hi) and reads K/V by slot in place;
torch's flash op takes an additive mask over gathered keys, or views of the pool for a single
sequence whose own keys are a few runs of slots.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixserve.kernels.attention.base import AttentionMetadata, SharedPrefixPlan
from radixserve.kernels.attention.metadata import host_tensor, slot_runs
from radixserve.kernels.attention.staging import Stage

# A bucket pads its units to one shape; it may waste at most this many padded (query, key)
# pairs per unit, about what a separate call's overhead costs (so decodes of different lengths
# share a call, long prefill blocks keep their own).
PAD_SLACK = 2048
QUERY_BLOCK = 256  # a prefill chunk's queries per unit (its causal triangle is cut at this grain)
KEY_ALIGN = 16  # flash op: gathered keys are padded to this multiple (measured: 61 keys 69 us, 64 keys 53 us)


@dataclass
class Bucket:
    """Sequences attended in one padded call: [num, max_q] queries over [num, max_k] own keys."""

    num: int
    max_q: int
    max_k: int
    q_idx: torch.Tensor | None  # [num * max_q] int64 token rows of q, padding repeats a valid row (flash op)
    valid: torch.Tensor | None  # [num * max_q] bool, None when no query is padding
    out_rows: torch.Tensor | None  # [num_valid] int64 token rows the valid queries write (flash op)
    kv_idx: torch.Tensor | None  # [num * max_k] int64 slots; None = read through `runs`
    runs: list[tuple[int, int]] | None  # one sequence's own keys as views [(first slot, length)]
    run_masks: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None  # per run: (mask, rows seeing it)
    mask: torch.Tensor | None  # [num, 1, max_q * group, max_k] additive float mask, None = none
    # Native kernel: stacked row r of unit u sees own keys [lo[u, r], hi[u, r]); int32 [num, max_q * group]
    # (lo None: 0).
    bounds: tuple[torch.Tensor | None, torch.Tensor] | None
    # Native kernel: int32 [num, max_q] the token (row of q and of the result) of each query, -1 = padding.
    tokens: torch.Tensor | None
    # Flash op, stacked layout: columns the valid queries' results go to, and (None = all) which
    # of the bucket's num * max_q * group result columns are valid.
    stack_cols: torch.Tensor | None
    stack_src: torch.Tensor | None
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # gathered K / V rows, reused per layer
    seq_rows: tuple[int, ...] = ()  # the members' slot-table rows
    k_lens: tuple[int, ...] = ()  # the members' own keys
    stage: Stage | None = None  # a decode bucket's own keys kept from the previous step (staging.py)


@dataclass
class Piece:
    """The reads of one shared prefix under the flash op: its runs of slots (views), or [None] =
    all of them gathered (the native kernel reads shared prefixes through SharedBatch instead)."""

    shared: SharedPrefixPlan
    runs: list[tuple[int, int] | None]
    cols: slice | torch.Tensor  # stacked-layout columns of every query below the prefix


@dataclass
class SharedBatch:
    """Shared prefixes read in one native call, each merged into the rows below it: entry p
    holds prefix p's queries (``tokens``, -1 = padding to the longest) over its keys (slots padded
    to the longest prefix); ``bounds`` give real rows all of their prefix's keys. No token sits
    below two pieces of one batch (nested prefixes go to successive batches)."""

    tokens: torch.Tensor  # int32 [P, t_max] rows of q below each piece
    slots: torch.Tensor  # [P, max keys] int64 (padding repeats a valid slot)
    bounds: tuple[None, torch.Tensor]  # (lo = 0, hi int32 [P, t_max * group]: the piece's length)


@dataclass
class StepPlan:
    buckets: list[Bucket]  # the own parts
    pieces: list[Piece]  # flash op: shared reads, outermost prefix first (native: none)
    native: bool  # read by the native kernel (native.py), else by torch's flash op / matmuls
    shared_batches: list[SharedBatch] | None = None  # native: the shared prefixes, one call per nesting level


def step_plan(meta: AttentionMetadata, window: int | None, group: int, use_shared: bool, native: bool) -> StepPlan:
    key = ("torch_plan", window, group, use_shared, native)
    if key not in meta.step_cache:
        buckets = _make_buckets(meta, window, group, use_shared, native)
        # Outermost first (merging is order-free; this keeps it fixed).
        shared = sorted(meta.shared, key=lambda p: p.prefix.kv_start) if use_shared else []
        if native:
            batches = [_shared_batch(meta, level, group) for level in _levels(shared)]
            meta.step_cache[key] = StepPlan(buckets, [], native, batches)
        else:
            meta.step_cache[key] = StepPlan(buckets, _shared_pieces(shared, group), native)
    return meta.step_cache[key]


def _shared_pieces(shared: list[SharedPrefixPlan], group: int) -> list[Piece]:
    """One piece per shared prefix, in the given order."""
    out = []
    for plan in shared:
        span = plan.q_row_range
        if span is not None:
            cols = slice(span[0] * group, span[1] * group)
        else:
            cols = (plan.q_rows[:, None] * group + torch.arange(group, device=plan.q_rows.device)).reshape(-1)
        out.append(Piece(plan, list(plan.runs) if plan.runs is not None else [None], cols))
    return out


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


def _make_buckets(meta: AttentionMetadata, window: int | None, group: int, use_shared: bool,
                  native: bool) -> list[Bucket]:
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
                                   group, native))
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
            own: list[int], window: int | None, group: int, native: bool) -> Bucket:
    """One padded call over units (seq, first query, num queries) seeing own keys
    [own_start, own_start + k_len) each; the unit's last query sits at the last of them."""
    if native:
        return _native_bucket(meta, units, k_lens, qo, own, window, group)
    table, device = meta.slot_table, meta.slot_table.device
    seqs = [i for i, _, _ in units]
    num = len(units)
    q_lens = [n for _, _, n in units]
    starts = [own[i] for i in seqs]
    max_q, max_k = max(q_lens), max(k_lens)
    runs = _own_runs(table, meta, units[0][0], starts[0], k_lens[0]) if num == 1 else None
    if runs is None:  # gathered keys: pad to whole blocks of the op (a ragged tail is slow)
        max_k = -(-max_k // KEY_ALIGN) * KEY_ALIGN
    ints = torch.tensor([[qo[i] + off for i, off, _ in units], q_lens, k_lens, starts], dtype=torch.int64,
                        device=device)
    q_first, q_len_t, k_len_t, start_t = (row[:, None] for row in ints)  # each [num, 1]
    qj = torch.arange(max_q, device=device)[None, :]  # [1, max_q]
    kc = torch.arange(max_k, device=device)[None, :]  # [1, max_k]
    q_valid = qj < q_len_t  # [num, max_q]
    q_idx = (q_first + torch.minimum(qj, q_len_t - 1)).reshape(-1)
    valid = None if all(n == max_q for n in q_lens) else q_valid.reshape(-1)
    kv_idx = None if runs is not None else _own_slots(table, meta, seqs, kc, start_t, k_len_t)
    # Absolute positions: a unit's last query sees its last key; own key c at start + c.
    q_pos = (k_len_t + start_t - q_len_t) + qj  # [num, max_q]
    mask = _additive_mask(kc, k_len_t, start_t, q_pos, q_valid, window, group)
    out_rows = q_idx if valid is None else q_idx[valid]
    g = torch.arange(group, device=device)
    return Bucket(num=num, max_q=max_q, max_k=max_k, q_idx=q_idx, valid=valid, out_rows=out_rows, kv_idx=kv_idx,
                  runs=runs, run_masks=None if runs is None or mask is None else _split_mask(mask, runs), mask=mask,
                  bounds=None, tokens=None, stack_cols=(out_rows[:, None] * group + g).reshape(-1),
                  stack_src=None if valid is None else (torch.nonzero(valid).flatten()[:, None] * group
                                                        + g).reshape(-1),
                  seq_rows=tuple(meta.rows_list[i] for i in seqs), k_lens=tuple(k_lens))


def _native_bucket(meta: AttentionMetadata, units: list[tuple[int, int, int]], k_lens: list[int], qo: list[int],
                   own: list[int], window: int | None, group: int) -> Bucket:
    """_bucket for the native kernel: each query's token and own-key interval as host lists
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
    padded = any(n < max_q for _, _, n in units)
    return Bucket(num=num, max_q=max_q, max_k=max_k, q_idx=None, out_rows=None,
                  kv_idx=meta.slot_table[row, cols].reshape(-1), valid=(ints[0] >= 0).reshape(-1) if padded else None,
                  runs=None, run_masks=None, mask=None, tokens=ints[0], stack_cols=None, stack_src=None,
                  bounds=(per_row[1] if window is not None else None, per_row[0]))


def _per_stacked_row(x: torch.Tensor, group: int) -> torch.Tensor:
    """[num, max_q] -> [num, max_q * group], each value once per GQA head, contiguous (a copy into
    a fresh tensor: repeat_interleave costs ~30 us on the CPU, an expanded view has stride 0)."""
    out = x.new_empty((x.shape[0], x.shape[1] * group))
    out.view(x.shape[0], x.shape[1], group).copy_(x[:, :, None])
    return out


def _additive_mask(kc, k_len_t, start_t, q_pos, q_valid, window, group) -> torch.Tensor | None:
    """[num, 1, max_q * group, max_k] 0 / -inf over own keys c (None when every query sees every key)."""
    k_pos = start_t + kc  # [num, max_k]
    seen = (kc[:, None, :] < k_len_t[:, :, None]) & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        seen &= k_pos[:, None, :] > q_pos[:, :, None] - window
    seen |= ~q_valid[:, :, None] & (kc[:, None, :] == 0)  # padded queries see one key (no NaN)
    if bool(seen.all()):
        return None
    mask = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device).masked_fill_(~seen, float("-inf"))
    return mask.repeat_interleave(group, dim=1).unsqueeze(1)


def _split_mask(mask: torch.Tensor, runs: list[tuple[int, int]]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per run of keys: its slice of the mask (None when it hides nothing) and the [lq] rows
    that see at least one of its keys (None when every row does)."""
    out, col = [], 0
    for _, length in runs:
        part = mask[..., col:col + length]  # [1, 1, lq, length]
        col += length
        visible = part == 0
        seen = visible.any(-1).reshape(-1)  # [lq]
        out.append((None if bool(visible.all()) else part, None if bool(seen.all()) else seen))
    return out


def _own_runs(table, meta, seq: int, start: int, k_len: int) -> list[tuple[int, int]] | None:
    """One sequence's own keys as a few runs of the pool (read as views), or None."""
    if table.device.type != "cpu":
        return None
    return slot_runs(table[meta.rows_list[seq], start:start + k_len])


def _own_slots(table, meta, seqs, kc, start_t, k_len_t) -> torch.Tensor:
    """[num * max_k] slot index of the units' own keys; padding repeats a valid slot."""
    rows = meta.rows[torch.tensor(seqs, dtype=torch.int64, device=table.device)]
    col = torch.minimum(start_t + kc, start_t + k_len_t - 1)
    return table[rows[:, None], col].reshape(-1)
