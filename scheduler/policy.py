"""Ordering of the waiting queue (ARCHITECTURE §5). The planner admits requests in the returned
order and stops at the first one that does not fit, so the order is the whole decision.

Policies:
  fcfs         arrival order.
  lpm          longest cached prefix first (stable on arrival).
  dfs-weight   walk the tree of waiting prompts (shared prefixes, cached or not), heaviest subtree
               (most waiting requests) first, so requests that share a prefix run back to back.
  cache-aware  the default: the same walk, but subtrees whose prefix is already cached go first
               (cached tokens x waiting requests), plus in-batch prefix dedup and an
               anti-starvation rule (see PolicyConfig).

Under memory pressure with program scheduling on (the planner's `pressed`: admissions evict cached paths,
scheduler/sessions.py `under_pressure`), the overtake rule's ratio is 0: a request overtaken once goes first. There
the cache-aware order feeds on itself: a continuation whose history was evicted falls behind the cached ones and
waits while their admissions evict more; those turns are the tail of turn latency. Requests that arrive in the
same step still go in cache order.

Common to all: retracted requests go first (they already streamed tokens and hold cached
prefixes); with the radix cache disabled every policy is fcfs.

Cost: only the oldest `window` fresh requests are ordered; the rest follow in arrival order (the
planner admits at most max_running_requests per step anyway), and above `fcfs_queue_len` waiting
requests the whole queue is fcfs. Prompt block keys are computed once per request, cached
lengths once per request and tree epoch (RadixCache.epoch moves only when the cached set
changes; a new epoch resumes each match where it stopped: RadixCache.match_cursor), and the prefix-group tree only when the window or the claims change; a step where none
of those moved reuses the previous order. What is left per step is a few O(n) list passes.
"""
from __future__ import annotations

import logging

from .checks import check_choice
# PolicyConfig lives with EngineConfig (which carries it); imported from here as well.
from .config import SCHEDULE_POLICIES, PolicyConfig
from .fair_share import FairShare
from .kv_ops import PrefixKV
from .prefix_groups import PrefixGroups, block_key
from .req import Req, ReqStatus

logger = logging.getLogger(__name__)


class SchedulePolicy:
    def __init__(self, name: str, kv: PrefixKV, config: PolicyConfig | None = None):
        self.name = check_choice("schedule_policy", name, SCHEDULE_POLICIES)
        self.kv = kv
        self.config = config or PolicyConfig()
        self._keys: dict[str, tuple] = {}  # rid -> prompt block key (computed once)
        self._ahead: dict[str, int] = {}  # rid -> requests from earlier steps waiting at its arrival
        self._admitted_by_step: dict[int, int] = {}  # arrival step -> fresh requests admitted since
        self._last_order: list[Req] = []
        self._left: list[Req] = []  # admitted fresh requests that may still be prefilling (claims)
        self._matched: dict[str, tuple] = {}  # rid -> (req, epoch, cap, cached len, match cursor)
        self._groups: tuple | None = None  # (config, window, claims, PrefixGroups) of the last tree
        self._ordered: tuple | None = None  # (groups, epoch, walk order) of the last tree walk
        self.num_urgent = 0  # requests promoted by the starvation rule (for tests and stats)
        self.pressed = False  # memory under pressure, program scheduling on: overtaken once goes first (planner's)
        # Tenants, priorities and programs order what the policy ordered (scheduler/fair_share.py).
        self.share: FairShare | None = FairShare() if self.config.fair_share else None

    def order(self, waiting: list[Req], step: int, running: list[Req] | None = None) -> list[Req]:
        """Waiting requests in admission order; may omit requests deferred for prefix dedup.

        `waiting` is in arrival order apart from retracted requests (the planner appends new
        arrivals). The planner admits a prefix of the returned order and marks those RUNNING.
        running: the running requests, if the caller has them; otherwise the policy follows the
        requests it saw admitted. A prefill in progress defers waiting requests that share its
        uncached prefix (cache-aware only).
        """
        order, lead, window = self._cache_order(waiting, step, running)
        if self.share is not None:
            self.share.observe(waiting)
            order = self.share.order(order, self.cached_len, lead=lead, window=window)
        self._last_order = order
        return order

    def _cache_order(self, waiting: list[Req], step: int,
                     running: list[Req] | None) -> tuple[list[Req], int, list[Req]]:
        """The order, how many of its first entries this policy placed (the rest: fresh requests in arrival order),
        and the fresh requests it ordered itself (its window, deferred ones included)."""
        retracted = [r for r in waiting if r.num_retractions > 0]
        fresh = [r for r in waiting if r.num_retractions == 0]
        if self.name == "fcfs" or self.kv.tree.disable:
            return retracted + fresh, len(retracted), []
        self._observe(fresh)
        if len(waiting) > self.config.fcfs_queue_len:
            return retracted + fresh, len(retracted), []
        head, tail = fresh[:self.config.window], fresh[self.config.window:]
        window = head
        urgent = self._urgent(head, step) if self.name == "cache-aware" else []
        if urgent:
            urgent_ids = {id(r) for r in urgent}
            head = [r for r in head if id(r) not in urgent_ids]
        if self.name == "lpm":
            ordered = self._lpm(head)
        else:
            source = self._left if running is None else running
            claims = [r for r in source if _is_prefilling(r)] if self.name == "cache-aware" else []
            ordered = self._tree_order(head, claims)
        return retracted + urgent + ordered + tail, len(retracted) + len(urgent) + len(ordered), window

    # -- policies -----------------------------------------------------------------------

    def _lpm(self, window: list[Req]) -> list[Req]:
        match = [self.cached_len(r) for r in window]
        idx = sorted(range(len(window)), key=lambda i: -match[i])
        return [window[i] for i in idx]

    def _tree_order(self, window: list[Req], claims: list[Req]) -> list[Req]:
        cache_aware = self.name == "cache-aware"
        cfg = self.config
        last = self._groups
        if last is not None and last[0] is cfg and last[1] == window and last[2] == claims:
            groups = last[3]  # same requests (compared by identity), same tree
        else:
            groups = PrefixGroups(
                keys=[self._key(r) for r in window], lengths=[len(r.prompt_ids) for r in window],
                claim_keys=[self._key(r) for r in claims], claim_lengths=[len(r.prompt_ids) for r in claims],
                block_size=cfg.block_size)
            self._groups = (cfg, window, claims, groups)
        epoch = self.kv.tree.epoch if cache_aware else None
        done = self._ordered
        if done is not None and done[0] is groups and done[1] == epoch:
            picked = done[2]  # nothing the walk reads has changed
        else:
            cached = groups.cached_per_node(lambda i: self.cached_len(window[i])) if cache_aware else None
            picked = groups.dfs_order(cached=cached, dedup_min_tokens=cfg.dedup_min_tokens if cache_aware else None)
            self._ordered = (groups, epoch, picked)
        return [window[i] for i in picked]

    # -- anti-starvation ----------------------------------------------------------------

    def _observe(self, fresh: list[Req]) -> None:
        """Book the admissions since the previous call and the new arrivals; O(admitted + new).

        The planner admits a prefix of the returned order, so the admitted requests are the
        leading entries of the previous order that no longer wait. New arrivals are a suffix of
        `fresh` (the planner appends them).
        """
        for req in self._last_order:
            if req.status is ReqStatus.WAITING:
                break
            if req.rid in self._ahead:  # was fresh: counts towards overtaking older requests
                del self._ahead[req.rid]
                self._matched.pop(req.rid, None)
                self._admitted_by_step[req.arrival_step] = self._admitted_by_step.get(req.arrival_step, 0) + 1
                self._left.append(req)
        self._last_order = []
        still = []
        for req in self._left:
            if req.status is ReqStatus.RUNNING and _is_prefilling(req):
                still.append(req)
            else:
                self._keys.pop(req.rid, None)  # no longer a claim: its key is not needed again
        self._left = still
        first_new = len(fresh)
        while first_new > 0 and fresh[first_new - 1].rid not in self._ahead:
            first_new -= 1
        cohort_start = first_new
        for pos in range(first_new, len(fresh)):
            if pos == first_new or fresh[pos].arrival_step != fresh[pos - 1].arrival_step:
                cohort_start = pos
            self._ahead[fresh[pos].rid] = cohort_start
        bound = 2 * (len(fresh) + len(self._left)) + 256
        if max(len(self._ahead), len(self._keys), len(self._matched)) > bound:  # aborted requests linger
            live = {r.rid for r in fresh}
            self._ahead = {rid: n for rid, n in self._ahead.items() if rid in live}
            self._matched = {rid: m for rid, m in self._matched.items() if rid in live}
            live.update(r.rid for r in self._left)
            self._keys = {rid: k for rid, k in self._keys.items() if rid in live}
        if fresh:  # counts for steps no waiting request predates cannot matter any more
            oldest = fresh[0].arrival_step
            self._admitted_by_step = {s: n for s, n in self._admitted_by_step.items() if s > oldest}

    def _urgent(self, head: list[Req], step: int) -> list[Req]:
        """Requests promoted by the starvation rule, in arrival order. Only the head (the oldest
        `window` fresh requests) can be overtaken: everything admitted comes from it or is older."""
        cfg = self.config
        if cfg.starvation_rule == "none":
            return []
        if cfg.starvation_rule == "aging":
            urgent = [r for r in head if step - r.arrival_step >= cfg.max_wait_steps]
        else:
            # Overtakes of r = fresh requests admitted that arrived in a later step than r. The
            # head is in arrival order, so one pass over the per-step counts serves all of it.
            counts = sorted(self._admitted_by_step.items())
            ratio = 0.0 if self.pressed else cfg.overtake_ratio
            remaining = sum(n for _, n in counts)
            idx = 0
            urgent = []
            for req in head:
                while idx < len(counts) and counts[idx][0] <= req.arrival_step:
                    remaining -= counts[idx][1]
                    idx += 1
                if remaining >= max(1.0, ratio * self._ahead.get(req.rid, 0)):
                    urgent.append(req)
        self.num_urgent += len(urgent)
        return urgent

    # -- per-request helpers ------------------------------------------------------------

    def _key(self, req: Req) -> tuple:
        key = self._keys.get(req.rid)
        if key is None:
            key = block_key(req.tree_ids(len(req.prompt_ids)), req.tree_salt, self.config.block_size)
            self._keys[req.rid] = key
        return key

    def cached_len(self, req: Req) -> int:
        """Cached prefix admission would reuse now; read-only (no split, no access stamp).
        Memoised per request until the tree's epoch moves."""
        epoch = self.kv.tree.epoch
        cap = self.kv.match_cap(req)
        memo = self._matched.get(req.rid)
        same = memo is not None and memo[0] is req and memo[2] == cap
        if same and memo[1] == epoch:
            return memo[3]
        tokens = req.prompt_ids if cap <= len(req.prompt_ids) else req.all_ids  # no copy: the match stops at cap
        if req.params.cache_salt_after:
            tokens = req.tree_ids(cap)
        # The tree moved: resume from where the last match stopped (one child lookup while that node is cached).
        num, cursor = self.kv.tree.match_cursor(tokens, req.tree_salt, limit=cap, cursor=memo[4] if same else None)
        self._matched[req.rid] = (req, epoch, cap, num, cursor)
        return num


def _is_prefilling(req: Req) -> bool:
    # Running, prompt not fully computed: its uncached prefix will be in the tree soon.
    return not req.output_ids and req.kv_len < len(req.prompt_ids)
