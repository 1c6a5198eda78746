"""Who is admitted first between tenants, priorities and programs, and who gives memory back first
(ARCHITECTURE §5; issues 38 and 41 share this order).

Admission order, most significant first:
  1. tenant fair share: a virtual token counter per tenant (VTC, Sheng et al., OSDI 2024) counts the weighted
     service the tenant has received — prompt tokens computed (W_IN each), cached prompt tokens matched at
     admission (W_CACHED: cheaper, they are read, not computed) and output tokens sampled (W_OUT), divided by the
     tenant's weight. The backlogged tenant (one with requests waiting) with the lowest counter goes next. A
     tenant that becomes backlogged is lifted to the lowest counter of the tenants already backlogged (or, with
     none, to the counter of the last one that stopped being backlogged), so an idle tenant does not bank credit;
  2. within a tenant, `priority` (lower value first, vLLM's meaning);
  3. within a priority, the program's least attained service (Autellix's PLAS): a program is a session
     (`SamplingParams.session_id`), or the request alone. Service is discretised into levels (0 below
     LAS_QUANTUM, then one per doubling). A waiting request is not starved: once the engine has served others
     STARVATION_RATIO times its program's attained service since it joined the queue, it goes at level 0
     (Autellix's wait-to-service bound, in the engine's work rather than seconds), so that
  4. the cache-aware order (scheduler/policy.py) decides among the requests of one level.

Giving memory back (retraction when decode runs short; the planner's victim) takes the reverse: the running
request of the tenant furthest above its share (highest counter), within it the worst priority, then the highest
service level, then the least progress (fewest output tokens, latest arrival) — what would be admitted last goes
first. Session pins are dropped before any of this (scheduler/sessions.py: allocation reclaims pins). The same
order preempts: when the first request in admission order cannot be admitted, the running work `eligible` to give
way for it (its own tenant's of a worse priority, or a tenant's above its share) goes back to the queue, its
computed prefix kept cached (Planner._preempt).

Charging happens once per planned step (`charge_batch`), from the batch the planner built, so service is what
the engine actually ran. With one tenant, one priority and no program above level 0 the order is the cache-aware
order unchanged (`order` returns its input), and the victim is the least-progressed request, as before.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable

from .req import Req

DEFAULT_TENANT = "default"
# The lowest priority is idle-only: such a request is admitted only when nothing else runs or waits (a history
# prefetch, frontend/rewrite_prefetch.py). SamplingParams.priority stays within [-(2**31), IDLE_PRIORITY].
IDLE_PRIORITY = 2**31 - 1
W_IN, W_OUT, W_CACHED = 1.0, 2.0, 0.1  # service per computed prompt token, sampled token, cached prompt token
LAS_QUANTUM = 2048.0  # service (in W_IN tokens) below which a program is at level 0; each doubling adds a level
STARVATION_RATIO = 1.0  # service to others while waiting, over the program's own, that lifts it to level 0
MAX_PROGRAMS = 65_536  # attained service kept for this many programs (least recently served dropped)
MERGE_HEAD = 1024  # admission candidates merged by counter each step (a step admits far fewer)


def tenant_of(req: Req) -> str:
    return req.params.tenant or DEFAULT_TENANT


def request_cost(prompt_tokens: int, output_tokens: int) -> float:
    """The weighted cost of a request computing its whole prompt and `output_tokens` outputs (VTC's unit)."""
    return W_IN * prompt_tokens + W_OUT * output_tokens


class FairShare:
    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.counters: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._service: OrderedDict[str, float] = OrderedDict()  # program -> attained service
        self._backlogged: set[str] = set()
        self._waiting: dict[str, int] = {}  # tenant -> its queue's length at the last merge
        self._last_left = 0.0  # the counter of the last tenant that stopped being backlogged
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

    def charge(self, req: Req, computed: int = 0, cached: int = 0, sampled: int = 0) -> float:
        """Books service to the request's tenant and program; returns the (unweighted) cost."""
        cost = W_IN * computed + W_CACHED * cached + W_OUT * sampled
        if cost:
            self._served += cost
            tenant = tenant_of(req)
            self.counters[tenant] = self.counter(tenant) + cost / self.weight(tenant)
            program = req.params.session_id
            if program is not None:
                self._service[program] = self._service.pop(program, 0.0) + cost
                if len(self._service) > MAX_PROGRAMS:
                    self._service.popitem(last=False)
        return cost

    def charge_batch(self, items: Iterable, admitted_cached: Iterable[tuple[Req, int]] = ()) -> None:
        """One planned step: every item computes its tokens (a decode computes the last sampled one, which was
        charged as an output when it was sampled) and samples at most one; admissions add their cached tokens."""
        for item in items:
            self.charge(item.req, computed=0 if item.is_decode else item.num_tokens, sampled=int(item.sample))
        for req, cached in admitted_cached:
            self.charge(req, cached=cached)

    def level(self, req: Req) -> int:
        program = req.params.session_id
        service = self._service.get(program, 0.0) if program is not None else 0.0
        if self._served - self._queued.get(id(req), self._served) > STARVATION_RATIO * service:
            return 0  # waited long enough for its service: not starved behind newer programs
        level = 0
        while service >= LAS_QUANTUM * (1 << level) and level < 62:
            level += 1
        return level

    # -- admission ----------------------------------------------------------------------

    def observe(self, waiting: list[Req]) -> None:
        """Lifts the counters of tenants that became backlogged since the previous call (VTC's rule), and notes
        when each waiting request joined the queue (a retracted one joins again)."""
        self._queued = {id(r): self._queued.get(id(r), self._served) for r in waiting}
        now = {tenant_of(r) for r in waiting}
        before = self._backlogged & now
        for tenant in self._backlogged - now:
            self._last_left = self.counter(tenant)
        for tenant in now - self._backlogged:
            floor = min((self.counter(t) for t in before), default=self._last_left)
            self.counters[tenant] = max(self.counter(tenant), floor)
        self._backlogged = now

    def order(self, base: list[Req]) -> list[Req]:
        """`base` (the cache-aware order) reordered by tenant share, priority and program level; stable, so ties
        keep the cache-aware order. Returns `base` itself when nothing separates its requests. The tenants' queues
        are merged by counter for the first MERGE_HEAD entries (more than a step admits); the rest follow in
        `base`'s order. One pass over the queue when every request is at priority 0 without a session."""
        if len(base) < 2:
            return base
        queues: dict[str, list[Req]] = {}
        plain = True
        for r in base:
            p = r.params
            queues.setdefault(p.tenant or DEFAULT_TENANT, []).append(r)
            plain = plain and not p.priority and p.session_id is None
        if not plain:
            for queue in queues.values():
                queue.sort(key=self._key)
        if len(queues) == 1:
            return base if plain else next(iter(queues.values()))
        return self._merge(base, queues)

    def _key(self, req: Req) -> tuple[int, int]:
        return req.params.priority, self.level(req)

    def _merge(self, base: list[Req], queues: dict[str, list[Req]]) -> list[Req]:
        """The tenants' queues merged by counter, each admission's prompt cost projected onto its tenant so that one
        step's admissions interleave as the counters would."""
        # Equal counters (a tenant just lifted to the backlogged minimum) go to the shorter queue: the tenant that
        # asks for less is not made to wait a step for the one that asks for more.
        self._waiting = {t: len(q) for t, q in queues.items()}
        heap = [(self.counter(t), len(queues[t]), i, t) for i, t in enumerate(queues)]
        heapq.heapify(heap)
        heads = dict.fromkeys(queues, 0)
        out: list[Req] = []
        while heap and len(out) < MERGE_HEAD:
            counter, size, tie, tenant = heapq.heappop(heap)
            req = queues[tenant][heads[tenant]]
            heads[tenant] += 1
            out.append(req)
            if heads[tenant] < len(queues[tenant]):
                projected = counter + W_IN * len(req.prompt_ids) / self.weight(tenant)
                heapq.heappush(heap, (projected, size, tie, tenant))
        if len(out) < len(base):
            taken = {id(r) for r in out}
            out += [r for r in base if id(r) not in taken]
        return out

    # -- giving memory back -------------------------------------------------------------

    def victim(self, candidates: list[Req]) -> Req | None:
        """The running request that gives its memory back first (the reverse of the admission order)."""
        if not candidates:
            return None
        return max(candidates, key=lambda r: (self.counter(tenant_of(r)), r.params.priority, self.level(r),
                                              -len(r.output_ids), r.arrival_step))

    def eligible(self, req: Req, running: list[Req]) -> list[Req]:
        """The running requests `req` may preempt: its own tenant's of a worse priority, and any of a tenant whose
        counter is above `req`'s tenant's (above its share). Priority never reaches across tenants: another tenant's
        work goes only for the share, whatever `req`'s priority."""
        tenant = tenant_of(req)
        level = self._rank(tenant)
        return [r for r in running if (tenant_of(r) == tenant and r.params.priority > req.params.priority)
                or (tenant_of(r) != tenant and self._rank(tenant_of(r)) > level)]

    def _rank(self, tenant: str) -> tuple[float, int]:
        """A tenant's place in the last merge: its counter, then its queue's length (the merge's tie-break)."""
        return self.counter(tenant), self._waiting.get(tenant, 0)

    def may_preempt(self, waiting: list[Req], running: list[Req]) -> bool:
        """A cheap test that some waiting request has something eligible to preempt (one pass over each queue)."""
        best: dict[str, int] = {}  # tenant -> its best waiting priority
        for r in waiting:
            p = r.params
            t = p.tenant or DEFAULT_TENANT
            if p.priority < best.get(t, p.priority + 1):
                best[t] = p.priority
        lowest = min(self.counter(t) for t in best)
        return any(self.counter(tenant_of(r)) > lowest or r.params.priority > best.get(tenant_of(r), r.params.priority)
                   for r in running)
