"""Who is admitted first between tenants, priorities and programs, and who gives memory back first
(ARCHITECTURE §5; issues 38 and 41 share this order).

Admission order, most significant first:
  1. tenant fair share: a virtual token counter per tenant (VTC, Sheng et al., OSDI 2024) counts the weighted
     service the tenant has received — prompt tokens computed (W_IN each), cached prompt tokens matched at
     admission (W_CACHED: cheaper, they are read, not computed) and output tokens sampled (W_OUT), divided by the
     tenant's weight. The backlogged tenant (one with requests waiting) with the lowest counter goes next. A
     tenant that becomes backlogged is lifted to the lowest counter of the tenants already backlogged (or, with
     none, to the counter of the last one that stopped being backlogged), so an idle tenant does not bank credit.
     Counters within the next request's cache discount are tied ((W_IN - W_CACHED) x its cached tokens: its
     counter after admission stays within W_IN x its prompt of the lowest, as VTC's bound assumes), and a tie goes
     to the tenant with fewer requests waiting: a light tenant whose previous request was just admitted does not
     wait steps for a heavy one to be charged as much (issue 41: a burst of two light requests waited 1-3 steps);
  2. within a tenant, `priority` (lower value first, vLLM's meaning);
  3. within a priority, the program's least attained service (Autellix's PLAS): a program is a session
     (`SamplingParams.session_id`), or the request alone. Service is discretised into levels (0 below
     LAS_QUANTUM, then one per doubling). A program's service counts what it asked for, not what the engine did
     again: prompt tokens it computed before (its history recomputed after eviction or retraction) are charged to
     its tenant but not to its program, or a program the cache lost would fall a level, wait longer and lose more.
     Under memory pressure (the planner sets `las` off while admissions evict cached paths: scheduler/sessions.py
     `under_pressure`) the levels are set aside: serving the least attained first keeps the most programs alive at
     once, and their histories, a working set larger than the pool, push each other out of the cache (thrashing);
     the cache-aware order then decides, which admits the continuations whose histories are cached first (a request
     overtaken once goes first: policy.py). At any
     time a continuation whose history is held (`held`: pinned or still cached) goes at level 0. A waiting request
     is not starved: once the engine has served others
     STARVATION_RATIO times its program's attained service since it joined the queue, it goes at level 0
     (Autellix's wait-to-service bound, in the engine's work rather than seconds), so that
  4. the cache-aware order (scheduler/policy.py) decides among the requests of one level.

Giving memory back (retraction when decode runs short; the planner's victim) takes the reverse: the running
request of the tenant furthest above its share (highest counter), within it the worst priority, then the highest
service level, then the least progress (fewest output tokens, latest arrival) — what would be admitted last goes
first. Session pins are dropped before any of this (scheduler/sessions.py: allocation reclaims pins). The same
order preempts: when a request the step would admit cannot be admitted, the running work `eligible` to give
way for it (its own tenant's of a worse priority, or a tenant's above its share) goes back to the queue, its
computed prefix kept cached (Planner._preempt).

Charging happens once per planned step (`charge_batch`), from the batch the planner built, so service is what
the engine actually ran. With one tenant, one priority and no program above level 0 the order is the cache-aware
order unchanged (`order` returns its input), and the victim is the least-progressed request, as before.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Sequence

from .req import Req
from .tenant_queues import DEFAULT_TENANT, TenantQueues, tenant_of
# The lowest priority is idle-only: such a request is admitted only when nothing else runs or waits (a history
# prefetch, frontend/rewrite_prefetch.py). SamplingParams.priority stays within [-(2**31), IDLE_PRIORITY].
IDLE_PRIORITY = 2**31 - 1
W_IN, W_OUT, W_CACHED = 1.0, 2.0, 0.1  # service per computed prompt token, sampled token, cached prompt token
LAS_QUANTUM = 2048.0  # service (in W_IN tokens) below which a program is at level 0; each doubling adds a level
STARVATION_RATIO = 1.0  # service to others while waiting, over the program's own, that lifts it to level 0
MAX_PROGRAMS = 65_536  # attained service kept for this many programs (least recently served dropped)
MERGE_HEAD = 256  # admission candidates merged by counter each step (a step admits at most max_running_requests)
TIE_HEAD = 32  # of those, the first ones placed with ties (cached lengths looked up); the rest strictly by counter


def request_cost(prompt_tokens: int, output_tokens: int) -> float:
    """The weighted cost of a request computing its whole prompt and `output_tokens` outputs (VTC's unit)."""
    return W_IN * prompt_tokens + W_OUT * output_tokens


class FairShare:
    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.counters: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._service: OrderedDict[str, float] = OrderedDict()  # program -> attained service
        self._extent: dict[str, int] = {}  # program -> the furthest sequence position it has computed
        self.las = True  # program levels apply (the planner sets it off under memory pressure)
        self.queues = TenantQueues()  # the waiting requests by tenant
        self.tracked = False  # the planner reports every change of its queue (join / leave); else `observe` syncs
        self._waiting: dict[str, int] = {}  # tenant -> its queue's length at the last merge
        self._last_left: str | None = None  # the last tenant that stopped being backlogged
        self._served = 0.0  # all service charged so far
        self._queued: dict[int, float] = {}  # id of a waiting request -> _served when it joined the queue
        for name, weight in (weights or {}).items():
            self.set_weight(name, weight)

    def set_weight(self, tenant: str, weight: float) -> None:
        if not (isinstance(weight, (int, float)) and weight > 0):
            raise ValueError(f"tenant {tenant!r}: weight must be a positive number, got {weight!r}")
        self._weights[tenant] = float(weight)

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def weights(self) -> dict[str, float]:
        """The weights set (every other tenant weighs 1)."""
        return dict(self._weights)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    # -- service ------------------------------------------------------------------------

    def charge(self, req: Req, computed: int = 0, cached: int = 0, sampled: int = 0, recomputed: int = 0) -> float:
        """Books service to the request's tenant and program (less the `recomputed` of the computed tokens: its
        program had computed them before); returns the (unweighted) cost."""
        cost = W_IN * computed + W_CACHED * cached + W_OUT * sampled
        if cost:
            self._served += cost
            tenant = tenant_of(req)
            self.counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)
            program = req.params.session_id
            if program is not None:
                self._service[program] = self._service.pop(program, 0.0) + cost - W_IN * recomputed
                if len(self._service) > MAX_PROGRAMS:
                    self._extent.pop(self._service.popitem(last=False)[0], None)
        return cost

    def charge_batch(self, items: Iterable, admitted_cached: Iterable[tuple[Req, int]] = ()) -> None:
        """One planned step: every item computes its tokens (a decode computes the last sampled one, which was
        charged as an output when it was sampled) and samples at most one; admissions add their cached tokens."""
        for item in items:
            computed = 0 if item.is_decode else item.num_tokens
            self.charge(item.req, computed=computed, sampled=int(item.sample),
                        recomputed=self._recomputed(item.req, computed, item.num_tokens))
        for req, cached in admitted_cached:
            self.charge(req, cached=cached)

    def _recomputed(self, req: Req, computed: int, num_tokens: int) -> int:
        """Of the `computed` prompt tokens from the request's position (`num_tokens` computed in all, a decode's
        one included), those its program computed before (a session's turns extend one history, so positions below
        its furthest were its earlier turns')."""
        program = req.params.session_id
        if program is None:
            return 0
        start, extent = req.kv_len, self._extent.get(program, 0)
        self._extent[program] = max(extent, start + num_tokens)
        return min(max(extent - start, 0), computed)

    def held(self, req: Req, cached: int) -> bool:
        """Whether the request's `cached` prefix holds all its program computed before (a continuation whose history
        is pinned or still cached, less the last output token, which no step computed): admitting it costs only
        what is new, and waiting risks the history."""
        extent = self._extent.get(req.params.session_id, 0) if req.params.session_id is not None else 0
        return extent > 0 and cached >= extent - 1

    def level(self, req: Req) -> int:
        program = req.params.session_id
        if not self.las:
            return 0
        service = self._service.get(program, 0.0) if program is not None else 0.0
        if self._served - self._queued.get(id(req), self._served) > STARVATION_RATIO * service:
            return 0  # waited long enough for its service: not starved behind newer programs
        level = 0
        while service >= LAS_QUANTUM * (1 << level) and level < 62:
            level += 1
        return level

    # -- admission ----------------------------------------------------------------------

    def join(self, req: Req) -> None:
        """`req` starts waiting (an arrival, or a retraction: it joins again). A tenant that becomes backlogged is
        lifted to the lowest counter of those already backlogged, or with none to the counter of the last one that
        stopped being (VTC's rule); the request's wait is counted from now (`level`)."""
        self._queued[id(req)] = self._served
        if self.queues.join(req):
            tenant = tenant_of(req)
            floor = min((self.counter(t) for t in self.queues.tenants() if t != tenant), default=None)
            if floor is None:
                floor = self.counter(self._last_left) if self._last_left is not None else 0.0
            self.counters[tenant] = max(self.counter(tenant), floor)

    def leave(self, req: Req) -> None:
        """`req` stops waiting (admitted or aborted)."""
        self._queued.pop(id(req), None)
        if self.queues.leave(req):
            self._last_left = tenant_of(req)

    def observe(self, waiting: list[Req]) -> None:
        """For a caller that does not report its queue's changes (`tracked` False): `join` and `leave` from the
        difference between `waiting` and the queues (one pass)."""
        if self.tracked:
            return
        now = {id(r) for r in waiting}
        for req in self.queues.members():
            if id(req) not in now:
                self.leave(req)
        for req in waiting:
            if req not in self.queues:
                self.join(req)

    def slack(self, req: Req, cached: int) -> float:
        """How far above the lowest counter `req`'s tenant still ties: the discount its `cached` tokens get."""
        return (W_IN - W_CACHED) * cached / self.weight(tenant_of(req))

    def order(self, base: list[Req], cached_len: Callable[[Req], int] | None = None, lead: int | None = None,
              window: Sequence[Req] = ()) -> list[Req]:
        """`base` (the cache-aware order) reordered by tenant share, priority and program level; stable, so ties
        keep the cache-aware order. Returns `base` itself when nothing separates its requests. The tenants' queues
        are merged by counter for the first MERGE_HEAD entries (more than a step admits); the rest follow in
        `base`'s order. `cached_len(req)`: its cached prefix now (None: no ties but equal counters, prompts charged
        in full). With the queue `tracked` and every request at priority 0 without a session, no pass over `base`:
        its first `lead` entries are the policy's own order and the rest the other fresh requests in arrival order
        (`_lazy_queues`), so a step reads the merged head and the `lead`; otherwise one pass over the queue."""
        if len(base) < 2:
            return base
        if self.tracked and lead is not None and self.queues.plain:
            tenants = self.queues.tenants()
            if len(tenants) < 2:
                return base
            return self._merge(base, self._lazy_queues(base, lead, window, tenants), cached_len or _nothing_cached)
        queues: dict[str, list[Req]] = {}
        plain = True
        for r in base:
            p = r.params
            queues.setdefault(p.tenant or DEFAULT_TENANT, []).append(r)
            plain = plain and not p.priority and p.session_id is None
        if not plain:
            for queue in queues.values():
                queue.sort(key=lambda r: self._key(r, cached_len))
        if len(queues) == 1:
            return base if plain else next(iter(queues.values()))
        return self._merge(base, queues, cached_len or _nothing_cached)

    def _key(self, req: Req, cached_len: Callable[[Req], int] | None = None) -> tuple[int, int]:
        """Priority, then the program's level: 0 for a continuation whose history is held (`held`)."""
        if cached_len is not None and req.params.session_id in self._extent and self.held(req, cached_len(req)):
            return req.params.priority, 0
        return req.params.priority, self.level(req)

    def _lazy_queues(self, base: list[Req], lead: int, window: Sequence[Req], tenants: list[str]) -> dict[str, Any]:
        """Each tenant's queue in `base`'s order, read as the merge reaches it: its entries among `base[:lead]` (the
        retracted requests and the policy's `window` of fresh ones, some of which it may defer), then its other
        fresh requests in the order they joined, which is `base`'s after `lead`."""
        led: dict[str, list[Req]] = {t: [] for t in tenants}
        for req in base[:lead]:
            led[tenant_of(req)].append(req)
        deferred = dict.fromkeys(tenants, 0)  # in the window but not in base (prefix dedup)
        for req in window:
            deferred[tenant_of(req)] += 1
        for req in base[:lead]:
            if not req.num_retractions:
                deferred[tenant_of(req)] -= 1
        skip = {id(r) for r in window}
        return {t: _LazyQueue(led[t], self.queues.fresh_in_join_order(t, skip), self.queues.count(t) - deferred[t])
                for t in tenants}

    def _merge(self, base: list[Req], queues: dict[str, Any], cached_len: Callable[[Req], int]) -> list[Req]:
        """The tenants' queues merged by counter, each admission's cost projected onto its tenant so that one step's
        admissions interleave as the counters would; tied counters (`slack`) go to the shorter queue: the tenant
        that asks for less is not made to wait a step for the one that asks for more."""
        self._waiting = {t: len(q) for t, q in queues.items()}
        heap = [(self.counter(t), len(queues[t]), i, t) for i, t in enumerate(queues)]
        heapq.heapify(heap)
        heads = dict.fromkeys(queues, 0)
        out: list[Req] = []
        while heap and len(out) < MERGE_HEAD:
            ties = len(out) < TIE_HEAD
            entry = self._tied(heap, queues, heads, cached_len) if ties else heap[0]
            if entry is heap[0]:
                heapq.heappop(heap)
            else:
                heap.remove(entry)
                heapq.heapify(heap)
            counter, size, tie, tenant = entry
            req = queues[tenant][heads[tenant]]
            heads[tenant] += 1
            out.append(req)
            if heads[tenant] < len(queues[tenant]):
                cost = self.admission_cost(req, cached_len(req) if ties else 0, tenant)
                heapq.heappush(heap, (counter + cost, size, tie, tenant))
        if len(out) < len(base):
            taken = {id(r) for r in out}
            out += [r for r in base if id(r) not in taken]
        return out

    def _tied(self, heap: list, queues: dict[str, list[Req]], heads: dict[str, int],
              cached_len: Callable[[Req], int]) -> tuple:
        """The heap entry that goes next: the lowest counter's, or a shorter queue's whose counter ties with it."""
        best = heap[0]
        lowest = best[0]
        for entry in heap:
            counter, size, _, tenant = entry
            head = queues[tenant][heads[tenant]]
            if size >= best[1] or counter - lowest > (W_IN - W_CACHED) * len(head.prompt_ids) / self.weight(tenant):
                continue  # cannot win: no shorter queue, or beyond any slack its head could have (checked cheaply)
            if counter - lowest <= self.slack(head, cached_len(head)):
                best = entry
        return best

    # -- giving memory back -------------------------------------------------------------

    def victim(self, candidates: list[Req]) -> Req | None:
        """The running request that gives its memory back first (the reverse of the admission order)."""
        if not candidates:
            return None
        return max(candidates, key=lambda r: (self.counter(tenant_of(r)), r.params.priority, self.level(r),
                                              -len(r.output_ids), r.arrival_step))

    def eligible(self, req: Req, running: list[Req], cached: int = 0, ahead: float = 0.0) -> list[Req]:
        """The running requests `req` (with `cached` tokens cached) may preempt: its own tenant's of a worse
        priority, and any of a tenant that the merge would place after `req`'s (`goes_before`; `ahead`: the cost of
        its tenant's requests admitted before it this step, as the merge projects it). Priority never reaches
        across tenants: another tenant's work goes only for the share, whatever `req`'s priority."""
        tenant = tenant_of(req)
        slack = self.slack(req, cached)
        return [r for r in running if (tenant_of(r) == tenant and r.params.priority > req.params.priority)
                or (tenant_of(r) != tenant and self.goes_before(tenant, tenant_of(r), slack, ahead))]

    def admission_cost(self, req: Req, cached: int, tenant: str | None = None) -> float:
        """What admitting `req` (of `tenant`, if the caller knows it) with `cached` tokens cached adds to its
        tenant's counter (the merge's projection)."""
        return (W_IN * (len(req.prompt_ids) - cached) + W_CACHED * cached) / self.weight(tenant or tenant_of(req))

    def goes_before(self, tenant: str, other: str, slack: float, ahead: float = 0.0) -> bool:
        """Whether `tenant` (its next request tying within `slack`, `ahead` added to its counter) goes before
        `other`, as the last merge placed them: tied counters go to the shorter queue (then the lower counter),
        others to the lower counter."""
        mine, theirs = self.counter(tenant) + ahead, self.counter(other)
        if abs(mine - theirs) <= slack:
            return (self._waiting.get(tenant, 0), mine) < (self._waiting.get(other, 0), theirs)
        return mine < theirs

    def may_preempt(self, running: list[Req]) -> bool:
        """A cheap test that some waiting request has something eligible to preempt (from the queues' tallies, and
        one pass over the running requests)."""
        queues = self.queues
        counts = {t: queues.count(t) for t in queues.tenants()}  # tenant -> its requests waiting
        if not counts:
            return False
        best = {t: queues.best_priority(t) for t in counts}  # tenant -> its best waiting priority
        longest = queues.longest()  # the longest prompt waiting (a bound): no slack is larger than its discount
        lowest = min(self.counter(t) for t in best)
        if any(self.counter(tenant_of(r)) > lowest or r.params.priority > best.get(tenant_of(r), r.params.priority)
               for r in running):
            return True
        # A tie (goes_before): a waiting tenant a little above a running one that has more requests waiting.
        slack = (W_IN - W_CACHED) * longest
        running_tenants = {tenant_of(r) for r in running}
        return any(counts.get(g, 0) > n and self.counter(t) - self.counter(g) <= slack / self.weight(t)
                   for g in running_tenants for t, n in counts.items() if t != g)


def _nothing_cached(req: Req) -> int:
    return 0


class _LazyQueue:
    """A tenant's queue for the merge: `items`, then `more` pulled as it reads on; `size` entries in all."""

    def __init__(self, items: list[Req], more: Iterator[Req], size: int) -> None:
        self.items, self.more, self.size = items, more, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Req:
        while len(self.items) <= i:
            self.items.append(next(self.more))
        return self.items[i]
