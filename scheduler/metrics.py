"""Engine counters (read by stats(), /metrics and the benches) and the Histogram type.

Latency histograms are kept once, by the server (frontend/metrics.py), from each result's
ttft_s / e2e_s; the engine only stamps those times on its results."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from .fair_share import tenant_of

# Seconds; wide enough for CPU runs of tiny models and real GPU serving alike.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, last = above every bucket
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


STEP_PARTS = ("plan", "build", "forward", "sample", "outputs")


@dataclass
class EngineMetrics:
    num_prompt_tokens: int = 0  # first admissions only (§12)
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    num_steps: int = 0
    num_mixed_steps: int = 0  # steps that ran prefill chunks and decodes together
    max_batch_size: int = 0  # most sequences in one forward so far
    num_forward_tokens: int = 0  # tokens actually computed (incl. re-prefills after retraction)
    # Jump-forward (scheduler/jump_forward.py): jumps made (one request in one step each), forced
    # tokens they appended beyond the sampled one, and jumps whose retokenization replaced it.
    num_jump_forward_steps: int = 0
    num_jump_forward_tokens: int = 0
    num_jump_forward_retokenized: int = 0
    # The step profile: every step's wall time split into its parts (seconds, cumulative).
    # plan: inbox + planner + radix; build: step inputs (engine + runner); forward: the model;
    # sample: sampling and logprobs; outputs: tokens appended, detokenize, stops, deltas, caching.
    step_time_s: float = 0.0
    step_parts_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    num_shared_prefix_steps: int = 0  # steps whose attention read shared prefixes once
    num_shared_prefix_tokens: int = 0  # KV tokens of those prefixes (each counted once per step)
    num_shared_prefix_reads_saved: int = 0  # per-request reads of them that were not needed
    # Prefix-only requests (max_new_tokens=0: cache warm-ups, the server's history prefetches) and the prompt
    # tokens they had to compute.
    num_prefix_only_requests: int = 0
    num_prefix_only_computed: int = 0

    def count_admission(self, prompt_tokens: int, cached_tokens: int, prefix_only: bool) -> None:
        """A prefix-only request (max_new_tokens=0, a cache warm-up) is left out of the hit rate (§12)."""
        if not prefix_only:
            self.num_prompt_tokens += prompt_tokens
            self.num_cached_tokens += cached_tokens
        else:
            self.num_prefix_only_requests += 1
            self.num_prefix_only_computed += prompt_tokens - cached_tokens

    @property
    def cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def slots_by_tenant(running: list[Any]) -> dict[str, int]:
    """KV slots each tenant's running requests hold (their cached prefixes included, so a prefix two tenants
    share counts for both)."""
    held: dict[str, int] = {}
    for req in running:
        tenant = tenant_of(req)
        held[tenant] = held.get(tenant, 0) + len(req.kv_slots)
    return held


def engine_stats(kv: Any, planner: Any, m: EngineMetrics) -> dict[str, Any]:
    """Engine.stats(): the KV identity's parts, the queues, the counters and the sessions' pins."""
    tree = kv.tree
    return {
        "total_slots": kv.total_slots, "free_slots": kv.allocator.num_free_slots,
        "evictable_slots": tree.evictable_size, "locked_slots": tree.locked_size,
        "in_flight_slots": sum(r.owned_slots for r in planner.running),
        "num_running": len(planner.running), "num_waiting": len(planner.waiting),
        "cache_hit_rate": m.cache_hit_rate, "num_prompt_tokens": m.num_prompt_tokens,
        "num_cached_tokens": m.num_cached_tokens, "num_generated_tokens": m.num_generated_tokens,
        "num_evicted_tokens": tree.num_evicted_tokens, "num_requests_finished": m.num_requests_finished,
        "num_requests_aborted": m.num_requests_aborted, "num_retractions": planner.num_retractions,
        "num_steps": m.num_steps, "num_mixed_steps": m.num_mixed_steps, "max_batch_size": m.max_batch_size,
        "num_forward_tokens": m.num_forward_tokens,
        "num_jump_forward_steps": m.num_jump_forward_steps,
        "num_jump_forward_tokens": m.num_jump_forward_tokens,
        "num_jump_forward_retokenized": m.num_jump_forward_retokenized,
        "num_shared_prefix_steps": m.num_shared_prefix_steps,
        "num_shared_prefix_tokens": m.num_shared_prefix_tokens,
        "num_shared_prefix_reads_saved": m.num_shared_prefix_reads_saved,
        "num_prefix_only_requests": m.num_prefix_only_requests,
        "num_prefix_only_computed": m.num_prefix_only_computed,
        "step_time_s": m.step_time_s, "step_parts_s": dict(m.step_parts_s),
        "tenant_slots": slots_by_tenant(planner.running),
        "tenant_caps": dict(planner.tenant_caps),
        "tenant_weights": planner.policy.share.weights() if planner.policy.share is not None else {},
        **kv.sessions.stats(),
        **kv.swap_stats(),
    }
