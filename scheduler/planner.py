"""The planner: turns the waiting and running queues into one mixed Batch per step.

Order of work in a step (ARCHITECTURE §5):
  1. room for every decode (one token each), retracting the least-progressed requests if
     the pool runs short;
  2. continue chunked prefills, then admit waiting requests in policy order, while the
     token budget, max_running_requests and KV room (minus the running requests'
     estimated decode room) allow.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .checks import check_int
from .config import EngineConfig
from .fair_share import IDLE_PRIORITY, tenant_of
from .kv_ops import PrefixKV
from .policy import SchedulePolicy
from .req import Req, ReqStatus
from .step_budget import StepBudget

logger = logging.getLogger(__name__)

# Decode-room estimate for admission: a running request is assumed to still need
# new_token_ratio * (its remaining max_new_tokens). The ratio starts cautious, relaxes as
# steps pass without retraction, and jumps back after one (as SGLang does).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


@dataclass
class BatchItem:
    req: Req
    num_tokens: int  # computes all_ids[kv_len : kv_len + num_tokens]
    sample: bool
    is_decode: bool = False


@dataclass
class Batch:
    items: list[BatchItem] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return sum(1 for it in self.items if it.is_decode)

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_decodes < len(self.items)


class Planner:
    def __init__(self, config: EngineConfig, kv: PrefixKV, policy: SchedulePolicy):
        self.config = config
        self.kv = kv
        self.policy = policy
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self._step_order: list[Req] | None = None  # this step's admission order (_order)
        self.tenant_caps: dict[str, int] = {}  # tenant -> most requests running at once (Engine.set_tenants)
        self.budget = StepBudget(config.chunked_prefill_size, config.page_size)  # prompt tokens per step
        if policy.share is not None:
            policy.share.tracked = True  # every change of `waiting` is reported to it (enqueue, _dequeue, _retract)

    def schedule(self, step: int) -> tuple[Batch, list[Req]]:
        """Plan one step. Returns the batch and the requests admitted for the first time."""
        self._step_order = None
        # Under memory pressure program levels yield to the cache (fair_share.py), and the cache to arrival order
        # once a request is overtaken (policy.py: `pressed`); both are program scheduling (the agent cache's flag).
        self.policy.pressed = self.kv.agent_cache and self.kv.sessions.under_pressure()
        if self.policy.share is not None:
            self.policy.share.las = self.kv.agent_cache and not self.policy.pressed
        budget, lead_tenant = self._prefill_budget(step)
        self._preempt(step, budget)
        self.kv.hint(self.waiting)  # new arrivals and retracted requests: what they will match is evicted last
        batch = Batch()
        self._reserve_decodes(batch)
        budget = self._continue_prefills(batch, budget, lead_tenant)
        admitted = self._admit(batch, budget, step)
        if not batch.items and lead_tenant is not None:  # its leading requests did not fit: the others' go on
            self._continue_prefills(batch, budget, None)
        if not batch.items and self.running:
            # Everyone holds memory and nobody can progress: free the least-progressed.
            self._retract(self._pick_victim(exclude=None))
        if self.policy.share is not None:  # the service this step gives, as the fair share counts it
            self.policy.share.charge_batch(batch.items, [(r, r.cached_tokens or 0) for r in admitted])
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return batch, admitted

    def _prefill_budget(self, step: int) -> tuple[int, str | None]:
        """The step's prompt tokens: chunked_prefill_size, or less while tenants share the engine (step_budget.py):
        never below the uncached prompts of the first request in admission order (and the chunked prompts under way
        before it) and, while another tenant waits too, of the requests of its tenant that go before any other's (a
        light tenant's pair starts together); then the step is theirs alone: no more than that, and the second
        value names their tenant, whose chunked prompts alone go on in it."""
        share = self.policy.share
        if share is None:
            return self.config.chunked_prefill_size, None
        waiting = share.queues.tenants()
        if not self.budget.shared(step, {tenant_of(r) for r in self.running} | set(waiting)):
            return self.config.chunked_prefill_size, None
        if not self.waiting:
            return self.budget.tokens(self._chunked_pending(None), self.kv.sessions.prefill_s_per_token), None
        order = self._order(step)
        lead_tenant = tenant_of(order[0]) if len(waiting) > 1 else None
        uncached = self._chunked_pending(lead_tenant)
        for req in order[:self.config.max_running_requests] if lead_tenant is not None else order[:1]:
            if tenant_of(req) != tenant_of(order[0]):
                break
            uncached += req.seq_len - self.policy.cached_len(req)
        return (self.budget.tokens(uncached, self.kv.sessions.prefill_s_per_token, others_wait=lead_tenant is not None),
                lead_tenant)

    def _chunked_pending(self, tenant: str | None) -> int:
        """Prompt tokens still to compute of the running requests' chunked prompts (of `tenant`; None: anyone's)."""
        return sum(r.num_pending for r in self.running
                   if not r.is_decoding and (tenant is None or tenant_of(r) == tenant))

    def set_tenants(self, settings: dict[str, dict[str, Any]]) -> None:
        """Per tenant its fair-share `weight` and `max_running_requests` (Engine.set_tenants)."""
        for name, tenant in settings.items():
            if self.policy.share is not None:
                self.policy.share.set_weight(name, tenant.get("weight", 1.0))
            cap = tenant.get("max_running_requests")
            if cap is not None:
                self.tenant_caps[name] = check_int(f"tenant {name!r}: max_running_requests", cap, lo=1)

    def enqueue(self, req: Req) -> None:
        """A new request waits (Engine.admit)."""
        self.waiting.append(req)
        if self.policy.share is not None:
            self.policy.share.join(req)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._dequeue(req)
            self.kv.unhint(req)

    def _dequeue(self, req: Req) -> None:
        self.waiting.remove(req)
        if self.policy.share is not None:
            self.policy.share.leave(req)

    # -- step parts -------------------------------------------------------------------

    def _reserve_decodes(self, batch: Batch) -> None:
        decodes = [r for r in self.running if r.is_decoding]
        # Most progressed first: they are the last to be retracted.
        decodes.sort(key=_progress, reverse=True)
        for req in decodes:
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted while making room for an earlier one
            while not self.kv.reserve(req, 1):
                victim = self._pick_victim(exclude=None)
                if victim is req and len(self.running) == 1:
                    raise RuntimeError(f"request {req.rid} cannot get one KV slot with nothing else running")
                self._retract(victim)
                if victim is req:
                    break
        batch.items.extend(BatchItem(r, 1, True, is_decode=True) for r in decodes if r.status is ReqStatus.RUNNING)

    def _continue_prefills(self, batch: Batch, budget: int, tenant: str | None) -> int:
        """Chunked prompts go on (only `tenant`'s, when the step is its leading requests' alone)."""
        for req in self.running:
            if budget <= 0:
                break
            if req.is_decoding or (tenant is not None and tenant_of(req) != tenant):  # a decode: in the batch already
                continue
            num = self._fit_chunk(req, min(req.num_pending, budget))
            if num > 0:
                batch.items.append(self._item(req, num))
                budget -= num
        return budget

    def _admit(self, batch: Batch, budget: int, step: int) -> list[Req]:
        admitted: list[Req] = []
        if not self.waiting or budget <= 0:
            return admitted
        order = self._order(step)
        # The running requests' decode room, kept up to date as requests join them (nothing
        # else changes it within _admit: outputs, the ratio and the others stay as they are).
        decode_room = self._decode_room_estimate()
        shields = self._shield_prefixes(order, decode_room, budget)
        running = self._running_per_capped_tenant()
        self.kv.sessions.observe_backlog(self.kv.waiting_need)
        load = None  # load control (Sessions.starts): what started sessions bring back and the running hold
        try:
            for req in order:
                if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                    break
                if self._capped(req, running):
                    continue  # its tenant runs its most already: it waits, others go on
                if self.running and self.kv.sessions.starts(req.params.session_id):
                    load = self._load() if load is None else load
                    if load + req.seq_len > self.kv.history_room():
                        self.kv.sessions.hold(req.params.session_id)
                        continue  # a new program would thrash the started ones' histories: it waits for one to end
                tenant = tenant_of(req)
                if req.params.priority >= IDLE_PRIORITY and not self._idle():
                    continue  # idle-only work (a history prefetch) never shares a step with real work
                first_admission = req.cached_tokens is None
                if not self._try_admit(req, batch, budget, decode_room, shields.get(id(req))):
                    break  # head-of-line: smaller requests must not starve a big one
                decode_room += self._estimate(req)
                budget -= batch.items[-1].num_tokens
                if load is not None:
                    load += req.seq_len
                if tenant in running:
                    running[tenant] += 1
                if first_admission:
                    admitted.append(req)
        finally:
            for _, node in shields.values():
                self.kv.tree.unlock(node)
        return admitted

    def _load(self) -> int:
        """Load control's measure (Sessions.starts): the history tokens the started sessions bring back, and the
        running requests' tokens (those admitted this step included)."""
        return self.kv.sessions.returning_tokens() + sum(r.seq_len for r in self.running)

    def _idle(self) -> bool:
        """No work but idle-priority work is running or waiting."""
        return all(r.params.priority >= IDLE_PRIORITY for r in self.running) and all(
            r.params.priority >= IDLE_PRIORITY for r in self.waiting)

    def _running_per_capped_tenant(self) -> dict[str, int]:
        """Running requests of each tenant with a cap of its own (tenant_caps)."""
        running = dict.fromkeys(self.tenant_caps, 0)
        for req in self.running:
            tenant = tenant_of(req)
            if tenant in running:
                running[tenant] += 1
        return running

    def _capped(self, req: Req, running: dict[str, int]) -> bool:
        """Its tenant runs its most already (`running`: _running_per_capped_tenant): it waits, and nothing is
        preempted for it."""
        tenant = tenant_of(req)
        return tenant in running and running[tenant] >= self.tenant_caps[tenant]

    def _shield_prefixes(self, order: list[Req], decode_room: int,
                         budget: int) -> dict[int, tuple[list[int], Any]]:
        """Match and lock the cached prefixes of the leading candidates that fit together, before any of
        them allocates: the evictor picks leaves by priority, not by who waits, so admitting one
        candidate could otherwise evict the prefix the next one was ordered to reuse (its effect on the hit
        rate under a small cache: bench/results/cache_bench.md). Returns id(req) -> its match, which its
        admission takes as it is: nothing is inserted between the two, and the lock keeps the match valid.
        Only the candidates this step's token budget reaches are matched."""
        if self.kv.tree.disable:
            return {}
        shields = {}
        by_prompt: dict[tuple, tuple[list[int], Any]] = {}  # the choices of one prompt share its token list
        need = 0
        limit = max(self.config.max_running_requests - len(self.running), 0)
        for num, req in enumerate(order[:limit]):
            cap = self.kv.match_cap(req)
            key = (id(req.prompt_ids), req.params.cache_salt, cap) if cap <= len(req.prompt_ids) else None
            if key not in by_prompt:
                self.kv.restore(req)  # its session's history, where the swap tier holds more of it than the tree
            slots, node = by_prompt.get(key) or self.kv.match(req, record_hit=False)  # admission records the hit
            if key is not None:
                by_prompt[key] = (slots, node)
            self.kv.tree.lock(node)
            need += req.seq_len - len(slots) + self._estimate(req)
            if num > 0 and need > self.kv.available_slots() - decode_room:
                self.kv.tree.unlock(node)  # this one and the rest would not fit this step anyway
                break
            shields[id(req)] = (slots, node)
            budget -= req.seq_len - len(slots)
            if budget <= 0:
                break  # admission stops here too
        return shields

    def _try_admit(self, req: Req, batch: Batch, budget: int, decode_room: int,
                   matched: tuple[list[int], Any] | None) -> bool:
        cached = self.kv.admit(req, matched)
        num = min(req.num_pending, budget)
        need = self.kv.slots_needed(req, num)
        room = self.kv.available_slots() - decode_room
        if self.running and need + self._estimate(req) > room:
            self.kv.release(req)
            return False
        num = self._fit_chunk(req, num)
        if num <= 0:
            self.kv.release(req)
            return False
        if req.cached_tokens is None:
            req.cached_tokens = cached
        self._dequeue(req)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        batch.items.append(self._item(req, num))
        return True

    # -- helpers ------------------------------------------------------------------------

    def _item(self, req: Req, num: int) -> BatchItem:
        reaches_end = req.kv_len + num == req.seq_len
        return BatchItem(req, num, sample=reaches_end and req.params.max_new_tokens > 0)

    def _fit_chunk(self, req: Req, num: int) -> int:
        """Reserve slots for up to num tokens; shrink to what the pool can hold."""
        if self.kv.reserve(req, num):
            return num
        page = self.kv.page_size
        spare = len(req.kv_slots) - req.kv_len
        fit = spare + (self.kv.available_slots() // page) * page
        num = min(num, fit)
        return num if num > 0 and self.kv.reserve(req, num) else 0

    def _estimate(self, req: Req) -> int:
        remaining = req.params.max_new_tokens - len(req.output_ids) - self.kv.held_ahead(req)
        return int(self.new_token_ratio * max(remaining, 0))

    def _decode_room_estimate(self) -> int:
        return sum(self._estimate(r) for r in self.running)

    def _pick_victim(self, exclude: Req | None) -> Req | None:
        candidates = [r for r in self.running if r is not exclude]
        if self.policy.share is not None:  # the tenant furthest above its share, then the reverse admission order
            return self.policy.share.victim(candidates)
        return min(candidates, key=_progress) if candidates else None

    def _preempt(self, step: int, budget: int) -> None:
        """Preemption (vLLM's, generalised to tenants): while a request this step would admit (the leading ones in
        admission order, as many as its token budget reaches) cannot be admitted (no running slot, or not enough KV
        room beside the ones before it), running work that would be admitted after it goes back to the queue, the
        one admitted last in that order first: its own tenant's work of a worse priority, or the work of a tenant
        above its share (FairShare.eligible; the tenant's counter as the heads before it will have raised it).
        Its computed prefix stays cached, so it resumes where it stopped. Nothing is taken for a request unless
        taking everything eligible would make room; the first such request ends the pass. Two light requests
        arriving together both start in the next step (issue 41: the second waited a step for its own preemption)."""
        share = self.policy.share
        if share is None or not self.waiting or not self.running or not share.may_preempt(self.running):
            return  # the common case, in one pass over each queue
        running = self._running_per_capped_tenant()
        ahead: list[Req] = []  # the heads room was made for, in admission order
        for head in [r for r in self._order(step)[:self.config.max_running_requests] if not self._capped(r, running)]:
            cached = self.policy.cached_len(head)
            if budget <= 0 or not self._make_room(head, cached, ahead):
                return
            ahead.append(head)
            budget -= head.seq_len - cached
            tenant = tenant_of(head)
            if tenant in running:
                running[tenant] += 1

    def _make_room(self, head: Req, cached: int, ahead: list[Req]) -> bool:
        """Preempt what `head` may take until it fits beside `ahead`; False (nothing taken) if it cannot."""
        if self._fits(head, ahead=ahead):
            return True
        share = self.policy.share
        assert share is not None
        tenant = tenant_of(head)
        projected = sum(share.admission_cost(r, self.policy.cached_len(r), tenant) for r in ahead
                        if tenant_of(r) == tenant)
        eligible = share.eligible(head, self.running, cached, projected)  # counters hold still within the step
        if not self._fits(head, freed=eligible, ahead=ahead):
            return False
        while not self._fits(head, ahead=ahead):
            victim = share.victim(eligible)
            eligible.remove(victim)
            logger.info("preempting %s (tenant %s, priority %d) for %s (tenant %s, priority %d)", victim.rid,
                        victim.params.tenant, victim.params.priority, head.rid, head.params.tenant,
                        head.params.priority)
            self._retract(victim)
        return True

    def _order(self, step: int) -> list[Req]:
        """The policy's admission order, computed once per step: the budget's, preemption's and admission's look at
        the queue. A request retracted within the step (the only change to the queue before admission) waits for the
        next step's order: it would not be admitted back into the step that took its slots anyway, and ordering a
        long queue again costs milliseconds (a light tenant's request that preempts paid it on its first token)."""
        if self._step_order is None:
            self._step_order = self.policy.order(self.waiting, step, running=self.running)
        return self._step_order

    def _fits(self, req: Req, freed: list[Req] = (), ahead: list[Req] = ()) -> bool:
        """Whether admission would take `req` now, or once the `freed` running requests gave their slots back, after
        the waiting requests `ahead` of it: a running slot, and KV room for its uncached tokens and its decode
        estimate beside the running requests' and theirs (an estimate: admission decides for real)."""
        if len(self.running) + len(ahead) - len(freed) >= self.config.max_running_requests:
            return False
        need = sum(r.seq_len - self.policy.cached_len(r) + self._estimate(r) for r in (*ahead, req))
        room = self.kv.available_slots() + sum(r.owned_slots for r in freed)
        return need <= room - self._decode_room_estimate() + sum(self._estimate(r) for r in freed)

    def _retract(self, req: Req) -> None:
        logger.info("retracting %s (%d output tokens) to free KV", req.rid, len(req.output_ids))
        self.kv.release(req)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.waiting.insert(0, req)
        if self.policy.share is not None:
            self.policy.share.join(req)
        self.num_retractions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO


def _progress(req: Req) -> tuple[int, int]:
    # Least progress = fewest generated tokens; among equals, the latest arrival.
    return (len(req.output_ids), -req.arrival_step)
