"""The CPU attention backend: batched own-part attention plus shared-prefix (cascade) attention.

Per step (built once by ``prepare`` before the first layer, cached in ``meta.step_cache``): the
own parts ``[own_start, kv_len)`` become query units (a decode; a block of QUERY_BLOCK queries of
a prefill chunk, seeing the keys up to its last query), packed into a few padded buckets while
padding is cheap (PAD_SLACK), with K/V gather indices and additive masks read out of the slot
table by device-side ops. Per layer: one gather + one attention call per bucket (or views, for
one unit whose keys are a few runs of the pool), then one call per run of each shared prefix
over *all* queries below it, reading the prefix's K/V once as a view of the pool, each merged
by log-sum-exp into the rows below that prefix only. Sliding-window layers take the plain path
(own keys = all keys).

Decode buckets read their own keys from stages kept between steps (staging.py: only the keys
that changed are copied), head-major, with plain matmuls. Every other read goes through
``partials.attend`` (the CPU flash op, which returns the log-sum-exp the merges need). GQA
without copying K/V: the ``group`` q heads of one kv head are stacked along the query axis
(row r = token r // group, head r % group), so K/V keep their kv-head layout.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixserve.kernels.attention.base import AttentionMetadata, SharedPrefixPlan
from radixserve.kernels.attention.metadata import slot_runs
from radixserve.kernels.attention.partials import attend, attend_matmul, lse_merge, merge_into
from radixserve.kernels.attention.staging import OwnKeyStages, Stage, staged_keys
from radixserve.kernels.attention.torch_ref import store_kv

# A bucket pads its units to one shape; it may waste at most this many padded (query, key)
# pairs per unit, about what a separate call's overhead costs (so decodes of different lengths
# share a call, long prefill blocks keep their own).
PAD_SLACK = 2048
QUERY_BLOCK = 256  # a prefill chunk's queries per unit (its causal triangle is cut at this grain)
KEY_ALIGN = 16  # gathered keys are padded to this multiple (measured: 61 keys 69 us, 64 keys 53 us)


@dataclass
class _Bucket:
    """Sequences attended in one padded call: [num, max_q] queries over [num, max_k] own keys."""

    num: int
    max_q: int
    max_k: int
    q_idx: torch.Tensor  # [num * max_q] int64 token rows of q (padding repeats a valid row)
    out_rows: torch.Tensor  # [num_valid] int64 token rows the valid queries write
    valid: torch.Tensor | None  # [num * max_q] bool, None when no query is padding
    kv_idx: torch.Tensor | None  # [num * max_k] int64 slots; None = read through `runs`
    runs: list[tuple[int, int]] | None  # one sequence's own keys as views [(first slot, length)]
    run_masks: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None  # per run: (mask, rows seeing it)
    mask: torch.Tensor | None  # [num, 1, max_q * group, max_k] additive float mask, None = none
    # Stacked layout: columns the valid queries' results go to, and (None = all) which of the
    # bucket's num * max_q * group result columns are valid.
    stack_cols: torch.Tensor
    stack_src: torch.Tensor | None
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None  # gathered K / V rows, reused per layer
    seq_rows: tuple[int, ...] = ()  # the members' slot-table rows
    k_lens: tuple[int, ...] = ()  # the members' own keys
    stage: Stage | None = None  # a decode bucket's own keys kept from the previous step (staging.py)


@dataclass
class _Piece:
    """The reads of one shared prefix: its runs of slots (views), or [None] = all of them gathered."""

    shared: SharedPrefixPlan
    runs: list[tuple[int, int] | None]
    cols: slice | torch.Tensor  # stacked-layout columns of every query below the prefix


@dataclass
class _StepPlan:
    buckets: list[_Bucket]  # the own parts
    pieces: list[_Piece]  # shared reads, outermost prefix first


class TorchAttentionBackend:
    """Store, then bucketed own-part attention + shared prefixes, merged by log-sum-exp."""

    name = "torch"
    needs_kv_indices = False

    def __init__(self, stage_budget_slots: int | None = None) -> None:
        # Decode own keys kept between steps, at most this many pool slots' worth (None: no limit).
        self.stages = OwnKeyStages(stage_budget_slots)

    def prepare(self, meta: AttentionMetadata, group: int, windows: set[int | None]) -> None:
        plans = []
        for window in windows:
            window = window if window is not None and window > 0 else None
            plans.append((window, _step_plan(meta, window, group, bool(meta.shared) and window is None)))
        # One stage per decode bucket of each plan (window layers have buckets of their own).
        staged = [(window, b) for window, plan in plans for b in plan.buckets if b.kv_idx is not None and b.max_q == 1]
        stages = self.stages.refresh([((window, *b.seq_rows), b.kv_idx.view(b.num, b.max_k), b.k_lens)
                                      for window, b in staged])
        for (_, b), stage in zip(staged, stages):
            b.stage = stage

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, sm_scale: float,
                sliding_window: int | None) -> torch.Tensor:
        store_kv(k_cache, v_cache, k, v, meta.out_slot_ids)
        return cascade_attention(q, k_cache, v_cache, meta, sm_scale, sliding_window)


def cascade_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of each sequence's new tokens over its KV (same result as
    ``torch_ref.extend_attention``), reading every shared prefix of ``meta.shared`` once.

    Every token's own part writes the result first; then each shared prefix's reads (one per run
    of its slots) are merged by log-sum-exp into just the rows below it, in place, so a step pays
    merge work only for the queries that sit below a shared prefix."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    group = q.shape[1] // k_cache.shape[1]
    plan = _step_plan(meta, window, group, bool(meta.shared) and window is None)
    num_tokens, num_q_heads, head_dim = q.shape
    if not plan.pieces:
        out = q.new_empty((num_tokens, num_q_heads, head_dim))
        for b in plan.buckets:
            b_out, _ = _bucket_attention(q, k_cache, v_cache, b, sm_scale, group)
            out.index_copy_(0, b.out_rows, (b_out if b.valid is None else b_out[b.valid]).to(out.dtype))
        return out
    # The result lives in the stacked layout [kv_heads, num_tokens * group, d] (column t * group + j
    # of kv head h = token t, q head h * group + j), the layout the attention op reads and writes,
    # so the rows below a shared prefix are a plain slice of it.
    num_kv_heads = k_cache.shape[1]
    cols = num_tokens * group
    out = torch.empty((num_kv_heads, cols, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_kv_heads, cols), dtype=torch.float32, device=q.device)
    for b in plan.buckets:  # the own parts cover every column: every token sees itself
        o, b_lse = _bucket_attention(q, k_cache, v_cache, b, sm_scale, group, stacked=True)
        if b.stack_src is not None:  # drop padded queries
            o, b_lse = o.index_select(1, b.stack_src), b_lse.index_select(1, b.stack_src)
        out.index_copy_(1, b.stack_cols, o.float())
        lse.index_copy_(1, b.stack_cols, b_lse)
    for piece in plan.pieces:
        rows, where = piece.shared.q_row_range, piece.cols
        qs = q[rows[0]:rows[1]] if rows is not None else q.index_select(0, piece.shared.q_rows)
        qs = qs.view(-1, num_kv_heads, group, head_dim).transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
        if rows is not None:  # views: merged in place
            o_acc, lse_acc = out[:, where], lse[:, where]
        else:
            o_acc, lse_acc = out.index_select(1, where), lse.index_select(1, where)
        for run in piece.runs:
            o, s_lse = _shared_attention(qs, k_cache, v_cache, piece.shared, run, sm_scale)
            merge_into(o_acc, lse_acc, o[0], s_lse[0])
        if rows is None:
            out.index_copy_(1, where, o_acc)
            lse.index_copy_(1, where, lse_acc)
    out = out.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)
    return out.reshape(num_tokens, num_q_heads, head_dim).to(q.dtype)


# -- per layer ---------------------------------------------------------------------------------

def _bucket_attention(q, k_cache, v_cache, b: _Bucket, sm_scale: float, group: int, stacked: bool = False):
    """The bucket's own-part attention: token-major ([num * max_q, q_heads, d], [.., q_heads]),
    or with stacked=True in the stacked layout ([kv_heads, num * max_q * group, d], [kv_heads, ..])."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    qb = q.index_select(0, b.q_idx).view(b.num, b.max_q, num_kv_heads, group, head_dim)
    qb = qb.permute(0, 2, 1, 3, 4).reshape(b.num, num_kv_heads, b.max_q * group, head_dim)
    if b.kv_idx is None:  # one sequence whose own keys are a few runs of the pool: views
        o, lse = _attend_runs(qb, k_cache, v_cache, b.runs, b.run_masks, sm_scale)
    elif b.stage is not None:  # a decode bucket's own keys, kept from the previous step
        keys, values = staged_keys(b.stage, k_cache, v_cache, b.max_k)  # [num, kv_heads, max_k, d]
        o, lse = attend_matmul(qb, keys, values, b.mask, sm_scale)
    else:
        if b.workspace is None:  # one buffer pair per step, reused by every layer
            b.workspace = (k_cache.new_empty((b.kv_idx.numel(), num_kv_heads * head_dim)),
                           v_cache.new_empty((b.kv_idx.numel(), num_kv_heads * head_dim)))
        keys = _gather(k_cache, b.kv_idx, b.workspace[0]).view(b.num, b.max_k, num_kv_heads, head_dim)
        values = _gather(v_cache, b.kv_idx, b.workspace[1]).view(b.num, b.max_k, num_kv_heads, head_dim)
        o, lse = attend(qb, keys.transpose(1, 2), values.transpose(1, 2), b.mask, sm_scale)
    if stacked:  # [num, kv_heads, max_q * group, d] -> [kv_heads, num * max_q * group, d]
        return (o.transpose(0, 1).reshape(num_kv_heads, -1, head_dim),
                lse.transpose(0, 1).reshape(num_kv_heads, -1))
    # [num, kv_heads, max_q * group, d] -> [num * max_q, q_heads, d]
    o = o.view(b.num, num_kv_heads, b.max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    lse = lse.view(b.num, num_kv_heads, b.max_q, group).permute(0, 2, 1, 3)
    return o.reshape(b.num * b.max_q, num_kv_heads * group, head_dim), lse.reshape(b.num * b.max_q, -1)


def _shared_attention(qs, k_cache, v_cache, plan: SharedPrefixPlan, run: tuple[int, int] | None,
                      sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One read of a shared prefix (a run of its slots as a view, or all of them gathered) for
    every query below it, all in the stacked layout: qs [1, kv_heads, n * group, d] -> out (same
    shape) and lse [1, kv_heads, n * group]. No mask: every query comes after every shared key."""
    if run is not None:
        first, length = run
        keys, values = k_cache[first:first + length], v_cache[first:first + length]
    else:
        keys, values = _gather(k_cache, plan.slots), _gather(v_cache, plan.slots)
    return attend(qs, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), None, sm_scale)


def _gather(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache[slots] -> [n, kv_heads, d]: rows of a 2-D view copy about 2.5x faster than 3-D
    indexing on the CPU, and into a reused buffer (a fresh multi-MB tensor per layer costs page
    faults)."""
    num_slots, num_kv_heads, head_dim = cache.shape
    flat = cache.view(num_slots, num_kv_heads * head_dim)
    rows = torch.index_select(flat, 0, slots, out=out) if out is not None else flat.index_select(0, slots)
    return rows.view(-1, num_kv_heads, head_dim)


def _attend_runs(q, k_cache, v_cache, runs: list[tuple[int, int]], run_masks, scale: float):
    """attend over keys that are consecutive runs of the pool, one view per run, merged.
    q [1, kv_heads, lq, d]; run_masks: per run (additive mask [1, 1, lq, length] or None, and
    [lq] bool rows that see some key of the run or None = all), or None = no masks."""
    o = lse = None
    for idx, (first, length) in enumerate(runs):
        keys = k_cache[first:first + length].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, length, d] view
        values = v_cache[first:first + length].transpose(0, 1).unsqueeze(0)
        mask, seen = run_masks[idx] if run_masks is not None else (None, None)
        o2, l2 = attend(q, keys, values, mask, scale)
        if seen is not None:  # a row that sees nothing here contributes nothing (lse -inf)
            l2 = l2.masked_fill(~seen, float("-inf"))
            o2 = o2.masked_fill(~seen[:, None], 0.0)  # the op leaves NaN on fully masked rows
        o, lse = (o2, l2) if o is None else lse_merge(o, lse, o2, l2)
    return o, lse


# -- per step ----------------------------------------------------------------------------------

def _step_plan(meta: AttentionMetadata, window: int | None, group: int, use_shared: bool) -> _StepPlan:
    key = ("torch_plan", window, group, use_shared)
    if key not in meta.step_cache:
        buckets = _make_buckets(meta, window, group, use_shared)
        pieces = _shared_pieces(meta, group) if use_shared else []
        meta.step_cache[key] = _StepPlan(buckets, pieces)
    return meta.step_cache[key]


def _shared_pieces(meta: AttentionMetadata, group: int) -> list[_Piece]:
    """One piece per shared prefix, outermost first (merging is order-free; this keeps it fixed)."""
    out = []
    for plan in sorted(meta.shared, key=lambda p: p.prefix.kv_start):
        span = plan.q_row_range
        if span is not None:
            cols = slice(span[0] * group, span[1] * group)
        else:
            cols = (plan.q_rows[:, None] * group + torch.arange(group, device=plan.q_rows.device)).reshape(-1)
        out.append(_Piece(plan, list(plan.runs) if plan.runs is not None else [None], cols))
    return out


def _make_buckets(meta: AttentionMetadata, window: int | None, group: int, use_shared: bool) -> list[_Bucket]:
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
            own: list[int], window: int | None, group: int) -> _Bucket:
    """One padded call over units (seq, first query, num queries) seeing own keys
    [own_start, own_start + k_len) each; the unit's last query sits at the last of them."""
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
    out_rows = q_idx if valid is None else q_idx[valid]
    kv_idx = None if runs is not None else _own_slots(table, meta, seqs, kc, start_t, k_len_t)
    # Absolute positions: a unit's last query sees its last key; own key c at start + c.
    q_pos = (k_len_t + start_t - q_len_t) + qj  # [num, max_q]
    k_pos = start_t + kc  # [num, max_k]
    seen = (kc[:, None, :] < k_len_t[:, :, None]) & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        seen &= k_pos[:, None, :] > q_pos[:, :, None] - window
    seen |= ~q_valid[:, :, None] & (kc[:, None, :] == 0)  # padded queries see one key (no NaN)
    mask = None
    if not bool(seen.all()):
        mask = torch.zeros(seen.shape, dtype=torch.float32, device=device).masked_fill_(~seen, float("-inf"))
        mask = mask.repeat_interleave(group, dim=1).unsqueeze(1)  # [num, 1, max_q * group, max_k]
    run_masks = None if runs is None or mask is None else _split_mask(mask, runs)
    g = torch.arange(group, device=device)
    stack_cols = (out_rows[:, None] * group + g).reshape(-1)
    stack_src = None if valid is None else (torch.nonzero(valid).flatten()[:, None] * group + g).reshape(-1)
    return _Bucket(num=num, max_q=max_q, max_k=max_k, q_idx=q_idx, out_rows=out_rows, valid=valid,
                   kv_idx=kv_idx, runs=runs, run_masks=run_masks, mask=mask, stack_cols=stack_cols,
                   stack_src=stack_src, seq_rows=tuple(meta.rows_list[i] for i in seqs), k_lens=tuple(k_lens))


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
    """[num * max_k] gather index of the units' own keys; padding repeats a valid slot."""
    rows = meta.rows[torch.tensor(seqs, dtype=torch.int64, device=table.device)]
    col = torch.minimum(start_t + kc, start_t + k_len_t - 1)
    return table[rows[:, None], col].reshape(-1)
