"""Ordering of the waiting queue (ARCHITECTURE §4). The planner admits requests in the returned
order and stops at the first one that does not fit, so the order is the whole decision.

Policies:
  fcfs         arrival order.
  lpm          longest cached prefix first (stable on arrival).
  dfs-weight   walk the tree of waiting prompts (shared prefixes, cached or not), heaviest subtree
               (most waiting requests) first, so requests that share a prefix run back to back.
  cache-aware  the default: the same walk, but subtrees whose prefix is already cached go first
               (cached tokens x waiting requests), plus in-batch prefix dedup and an
               anti-starvation rule (see PolicyConfig).

Common to all: retracted requests go first (they already streamed tokens and hold cached
prefixes); with the radix cache disabled every policy is fcfs.

Cost: only the oldest `window` fresh requests are ordered; the rest follow in arrival order (the
planner admits at most max_running_requests per step anyway). Per step that is O(window * prompt
blocks) plus one O(n) pass over the queue. Prompt block keys are computed once per request.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.scheduler.kv_ops import PrefixKV
from radixserve.scheduler.prefix_groups import PrefixGroups, block_key
from radixserve.scheduler.req import Req, ReqStatus

logger = logging.getLogger(__name__)

POLICIES = ("fcfs", "lpm", "dfs-weight", "cache-aware")
STARVATION_RULES = ("overtake", "aging", "none")


@dataclass(frozen=True)
class PolicyConfig:
    """Tuning knobs of the cache-aware policies (defaults chosen by measurement, bench/results)."""

    window: int = 256  # fresh requests ordered per step (oldest first); the rest stay fcfs
    block_size: int = 16  # prompt tokens per hashed block when grouping shared prefixes
    # Defer followers when the shared uncached prefix is at least this long (shared lengths are
    # seen in whole blocks, so 1 means: any uncached shared block).
    dedup_min_tokens: int = 1
    # Anti-starvation (cache-aware only):
    #   overtake: a request jumps ahead once more requests that arrived after it were admitted
    #             before it than max(1, overtake_ratio x the requests that were ahead of it when it
    #             arrived): fcfs would admit it after those, so it waits at most about
    #             (1 + overtake_ratio) times as many admissions. Requests arriving in the same step
    #             never count as overtaking each other, so batch arrivals keep the cache-aware order;
    #   aging:    a request jumps ahead once it has waited `max_wait_steps` engine steps.
    starvation_rule: str = "overtake"
    overtake_ratio: float = 0.5
    max_wait_steps: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.overtake_ratio, (int, float)) or self.overtake_ratio < 0:
            raise ValueError(f"overtake_ratio must be a non-negative number, got {self.overtake_ratio!r}")
        for name in ("window", "block_size", "max_wait_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.dedup_min_tokens, int) or self.dedup_min_tokens < 0:
            raise ValueError(f"dedup_min_tokens must be a non-negative integer, got {self.dedup_min_tokens!r}")
        if self.starvation_rule not in STARVATION_RULES:
            raise ValueError(f"starvation_rule must be one of {', '.join(STARVATION_RULES)}; "
                             f"got {self.starvation_rule!r}")


class SchedulePolicy:
    def __init__(self, name: str, kv: PrefixKV, config: PolicyConfig | None = None):
        if name not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(POLICIES)}; got {name!r}")
        self.name = name
        self.kv = kv
        self.config = config or PolicyConfig()
        self._keys: dict[str, tuple] = {}  # rid -> prompt block key (computed once)
        # rid -> (admissions, requests from earlier steps waiting, same-step requests waiting) at first sight
        self._tracks: dict[str, tuple[Req, int, int, int]] = {}
        self._left: list[Req] = []  # requests that left the queue and may still be prefilling
        self._cohorts: dict[int, tuple[int, int]] = {}
        self._num_admitted = 0  # fresh requests that left the queue (admitted or aborted)
        self._claim_ids: set[str] = set()
        self.num_urgent = 0  # requests promoted by the starvation rule (for tests and stats)

    def order(self, waiting: list[Req], step: int, running: list[Req] | None = None) -> list[Req]:
        """Waiting requests in admission order; may omit requests deferred for prefix dedup.

        running: the running requests, if the caller has them; otherwise the policy follows the
        requests that left its queue. A prefill in progress defers waiting requests that share
        its uncached prefix (cache-aware only).
        """
        retracted = [r for r in waiting if r.num_retractions > 0]
        fresh = [r for r in waiting if r.num_retractions == 0]
        fresh.sort(key=lambda r: (r.arrival_step, r.arrival_time))  # already sorted in practice: O(n)
        self._update_tracks(fresh)
        if self.name == "fcfs" or self.kv.tree.disable:
            return retracted + fresh
        urgent = self._urgent(fresh, step) if self.name == "cache-aware" else []
        if urgent:
            urgent_ids = {id(r) for r in urgent}
            fresh = [r for r in fresh if id(r) not in urgent_ids]
        window, tail = fresh[:self.config.window], fresh[self.config.window:]
        if self.name == "lpm":
            ordered = self._lpm(window)
        else:
            source = self._left if running is None else running
            claims = [r for r in source if _is_prefilling(r)] if self.name == "cache-aware" else []
            self._claim_ids = {r.rid for r in claims}
            ordered = self._tree_order(window, claims)
        return retracted + urgent + ordered + tail

    # -- policies -----------------------------------------------------------------------

    def _lpm(self, window: list[Req]) -> list[Req]:
        match = [self._cached_len(r) for r in window]
        idx = sorted(range(len(window)), key=lambda i: -match[i])
        return [window[i] for i in idx]

    def _tree_order(self, window: list[Req], claims: list[Req]) -> list[Req]:
        cache_aware = self.name == "cache-aware"
        groups = PrefixGroups(
            keys=[self._key(r) for r in window], lengths=[len(r.prompt_ids) for r in window],
            claim_keys=[self._key(r) for r in claims], claim_lengths=[len(r.prompt_ids) for r in claims],
            block_size=self.config.block_size)
        cached = groups.cached_per_node(lambda i: self._cached_len(window[i])) if cache_aware else None
        picked = groups.dfs_order(cached=cached,
                                  dedup_min_tokens=self.config.dedup_min_tokens if cache_aware else None)
        return [window[i] for i in picked]


    # -- anti-starvation ----------------------------------------------------------------

    def _update_tracks(self, fresh: list[Req]) -> None:
        """Count fresh requests that left the queue and note where new arrivals stand.

        Under fcfs a request is admitted after exactly the requests that arrived at earlier steps
        and were still waiting; every other admission, except of requests that arrived in the same
        step (whose relative order is arbitrary), is a later arrival overtaking it.
        """
        current = {r.rid for r in fresh}
        gone = [rid for rid in self._tracks if rid not in current]
        for rid in gone:
            self._left.append(self._tracks.pop(rid)[0])
        self._num_admitted += len(gone)
        # Requests that left the queue and are still prefilling are the dedup claims.
        self._left = [r for r in self._left if r.status is ReqStatus.RUNNING and _is_prefilling(r)]
        if len(self._keys) > 2 * len(fresh) + 512:
            # Admitted requests keep their key while they prefill (claims); drop the rest in bulk.
            self._keys = {rid: k for rid, k in self._keys.items() if rid in current or rid in self._claim_ids}
        self._cohorts = _cohorts(fresh)
        for req in fresh:
            if req.rid not in self._tracks:
                ahead, size = self._cohorts[req.arrival_step]
                self._tracks[req.rid] = (req, self._num_admitted, ahead, size)

    def _overtakes(self, req: Req) -> int:
        _, admitted_then, ahead_then, cohort_then = self._tracks[req.rid]
        ahead_now, cohort_now = self._cohorts[req.arrival_step]
        earlier_or_peers = (ahead_then - ahead_now) + (cohort_then - cohort_now)
        return (self._num_admitted - admitted_then) - earlier_or_peers

    def _overtake_limit(self, req: Req) -> float:
        ahead_then = self._tracks[req.rid][2]
        return max(1.0, self.config.overtake_ratio * ahead_then)

    def _urgent(self, fresh: list[Req], step: int) -> list[Req]:
        cfg = self.config
        if cfg.starvation_rule == "none":
            return []
        if cfg.starvation_rule == "aging":
            urgent = [r for r in fresh if step - r.arrival_step >= cfg.max_wait_steps]
        else:
            urgent = [r for r in fresh if self._overtakes(r) >= self._overtake_limit(r)]
        self.num_urgent += len(urgent)
        return urgent

    # -- per-request helpers ------------------------------------------------------------

    def _key(self, req: Req) -> tuple:
        key = self._keys.get(req.rid)
        if key is None:
            key = block_key(req.prompt_ids, req.params.cache_salt, self.config.block_size)
            self._keys[req.rid] = key
        return key

    def _cached_len(self, req: Req) -> int:
        """Cached prefix admission would reuse now; read-only (no split, no access stamp)."""
        cap = self.kv.match_cap(req)
        return len(self.kv.tree.peek_prefix(req.all_ids[:cap], salt=req.params.cache_salt))


def _cohorts(fresh: list[Req]) -> dict[int, tuple[int, int]]:
    """arrival_step -> (requests from earlier steps still waiting, requests of that step waiting);
    fresh is in arrival order."""
    out: dict[int, tuple[int, int]] = {}
    for pos, req in enumerate(fresh):
        ahead, size = out.get(req.arrival_step, (pos, 0))
        out[req.arrival_step] = (ahead, size + 1)
    return out


def _is_prefilling(req: Req) -> bool:
    # Running, prompt not fully computed: its uncached prefix will be in the tree soon.
    return not req.output_ids and req.kv_len < len(req.prompt_ids)
