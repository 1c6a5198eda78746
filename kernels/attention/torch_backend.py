"""The CPU attention backend: batched own-part attention plus shared-prefix (cascade) attention.

Per step, ``torch_plan.step_plan`` (once, before the first layer) turns the batch into buckets of
own-part query units and pieces of shared prefixes. Per layer: one attention call per bucket, then
one read of each shared prefix for *all* queries below it, merged by log-sum-exp into just the
rows below that prefix. Sliding-window layers take the plain path (own keys = all keys).

Reads go to radixserve's compiled kernel (native.py) where it is built and the pool is fp32: it
reads K/V by slot in place, so nothing is gathered and no mask is built (each row's key interval
is); it reads q and writes the result by token and merges each shared read into the rows below
it itself, so a layer is one call per bucket and one per nesting level of shared prefixes. Elsewhere they go to torch's flash op (``partials.attend``, which returns the log-sum-exp
the merges need) over gathered keys or views of the pool; there, decode buckets read their own
keys from stages kept between steps (staging.py: only the keys that changed are copied),
head-major, with plain matmuls. GQA without copying K/V: the ``group`` q heads of one kv head are stacked
along the query axis (row r = token r // group, head r % group), so K/V keep their kv-head layout.
"""
from __future__ import annotations

import torch

from radixserve.kernels import native as native_kernel
from radixserve.kernels.attention.base import AttentionMetadata, SharedPrefixPlan
from radixserve.kernels.attention.partials import attend, attend_matmul, lse_merge, merge_into
from radixserve.kernels.attention.staging import OwnKeyStages, staged_keys
from radixserve.kernels.attention.torch_plan import Bucket, StepPlan, step_plan
from radixserve.kernels.attention.torch_ref import store_kv


class TorchAttentionBackend:
    """Store, then bucketed own-part attention + shared prefixes, merged by log-sum-exp."""

    name = "torch"
    needs_kv_indices = False

    def __init__(self, stage_budget_slots: int | None = None, native: bool = False) -> None:
        # Decode own keys kept between steps, at most this many pool slots' worth (None: no limit).
        self.stages = OwnKeyStages(stage_budget_slots)
        self.native = native  # reads go to native.py's kernel (the caller checked native_kernel.supports)

    def prepare(self, meta: AttentionMetadata, group: int, windows: set[int | None]) -> None:
        plans = []
        for window in windows:
            window = window if window is not None and window > 0 else None
            plans.append((window, step_plan(meta, window, group, bool(meta.shared) and window is None, self.native)))
        # One stage per decode bucket of each plan (window layers have buckets of their own). The
        # native kernel reads decode keys by slot faster than matmuls read staged ones: no stages.
        staged = [(window, b) for window, plan in plans for b in plan.buckets
                  if b.kv_idx is not None and b.max_q == 1 and not self.native]
        stages = self.stages.refresh([((window, *b.seq_rows), b.kv_idx.view(b.num, b.max_k), b.k_lens)
                                      for window, b in staged])
        for (_, b), stage in zip(staged, stages):
            b.stage = stage

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, sm_scale: float,
                sliding_window: int | None) -> torch.Tensor:
        store_kv(k_cache, v_cache, k, v, meta.out_slot_ids)
        return cascade_attention(q, k_cache, v_cache, meta, sm_scale, sliding_window, native=self.native)


def cascade_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    native: bool | None = None,  # None: the native kernel wherever it supports the pool
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of each sequence's new tokens over its KV (same result as
    ``torch_ref.extend_attention``), reading every shared prefix of ``meta.shared`` once.

    Every token's own part writes the result first; then each shared prefix's reads (one per run
    of its slots) are merged by log-sum-exp into just the rows below it, in place, so a step pays
    merge work only for the queries that sit below a shared prefix."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    group = q.shape[1] // k_cache.shape[1]
    if native is None:
        native = native_kernel.supports(k_cache.dtype, k_cache.shape[2], k_cache.device)
    plan = step_plan(meta, window, group, bool(meta.shared) and window is None, native)
    if native:
        return _native_attention(q, k_cache, v_cache, plan, sm_scale)
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
        if rows is not None:  # views: merged in place
            o_acc, lse_acc = out[:, where], lse[:, where]
        else:
            o_acc, lse_acc = out.index_select(1, where), lse.index_select(1, where)
        qs = q[rows[0]:rows[1]] if rows is not None else q.index_select(0, piece.shared.q_rows)
        qs = qs.view(-1, num_kv_heads, group, head_dim).transpose(0, 1).reshape(1, num_kv_heads, -1, head_dim)
        for run in piece.runs:
            o, s_lse = _shared_attention(qs, k_cache, v_cache, piece.shared, run, sm_scale)
            merge_into(o_acc, lse_acc, o[0], s_lse[0])
        if rows is None:
            out.index_copy_(1, where, o_acc)
            lse.index_copy_(1, where, lse_acc)
    out = out.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1)
    return out.reshape(num_tokens, num_q_heads, head_dim).to(q.dtype)


# -- per layer ---------------------------------------------------------------------------------

def _native_attention(q, k_cache, v_cache, plan: StepPlan, sm_scale: float) -> torch.Tensor:
    """The native kernel reads q and writes the result by token, in place: each bucket's own
    part first, then each level of shared prefixes merged into the rows below it, so no query is
    copied, no partial result is gathered and no merge runs outside the kernel."""
    dtype = q.dtype
    q = q.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for b in plan.buckets:  # the own parts cover every token: every token sees itself
        native_kernel.attend_tokens(q, k_cache, v_cache, b.kv_idx.view(b.num, b.max_k), b.bounds, b.tokens,
                                    sm_scale, out, lse, merge=False)
    for batch in plan.shared_batches:
        native_kernel.attend_tokens(q, k_cache, v_cache, batch.slots, batch.bounds, batch.tokens, sm_scale,
                                    out, lse, merge=True)
    return out.to(dtype)


def _bucket_attention(q, k_cache, v_cache, b: Bucket, sm_scale: float, group: int, stacked: bool = False):
    """The bucket's own-part attention: token-major ([num * max_q, q_heads, d], [.., q_heads]),
    or with stacked=True in the stacked layout ([kv_heads, num * max_q * group, d], [kv_heads, ..])."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    qb = _stacked_queries(q, b.q_idx, b.max_q, num_kv_heads, group)
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


def _stacked_queries(q, token_idx: torch.Tensor, per_entry: int, num_kv_heads: int, group: int) -> torch.Tensor:
    """q's rows token_idx, per_entry tokens an entry, in the stacked layout the readers take:
    [entries, kv_heads, per_entry * group, d] (row r of kv head h = token r // group, q head h * group + r % group)."""
    head_dim = q.shape[2]
    qb = q.index_select(0, token_idx).view(-1, per_entry, num_kv_heads, group, head_dim)
    return qb.permute(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, per_entry * group, head_dim)


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


