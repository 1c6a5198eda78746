"""Per-tenant limits at admission (issue 41 item 5; the keys file's `limits`, frontend/tenants.py).

Every API admits its engine requests through `EngineClient.reserve`, which asks `TenantLimiter.admit` first, so
a tenant over a limit gets a 429 with `Retry-After` in the API's own error format (OpenAI's, or Anthropic's under
/v1/messages: errors.APIError.response). Where each limit is enforced:

- max_running_requests + max_queued_requests: requests the tenant has admitted here and not finished, counted in
  this process (as the server's own --max-running-requests + --max-queued-requests are); a tenant that gives only
  one of them gets the server's value for the other. max_running_requests is also the engine's: its admission
  runs at most that many of the tenant's requests at once (Planner.tenant_caps), the rest wait in its queue.
- tokens_per_minute: prompt + completion tokens of the tenant's requests that finished in the last 60 s, charged
  when each finishes; a request is refused while the window holds the limit or more (so the window may overshoot
  by what was in flight), and Retry-After says when enough of it has aged out.
- max_kv_share: KV slots held by the tenant's running requests (cached prefixes they lock included), as the
  engine reports them with every step (`EngineProcess.tenant_slots`), against that share of the pool; a request
  is refused while the tenant holds its share or more. The engine does not stop a running request from growing
  past it: the limit keeps new work out, it does not retract.
"""
from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Any, Callable

from .errors import APIError, bad_request
from .tenants import Tenant

WINDOW_S = 60.0
RETRY_AFTER_S = 1


class TenantLimiter:
    def __init__(self, engine: Any, max_running: int, max_queued: int, total_slots: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine  # an EngineProcess: tenant_slots, as of its last step
        self.max_running = max_running
        self.max_queued = max_queued
        self.total_slots = total_slots
        self.clock = clock
        self.in_flight: Counter[str] = Counter()
        self.refused: Counter[tuple[str, str]] = Counter()  # (tenant, limit) -> 429s, for /metrics
        self._window: dict[str, deque[tuple[float, int]]] = {}

    def cap(self, tenant: Tenant) -> int | None:
        """Engine requests the tenant may have queued or running here; None: only the server's capacity."""
        limits = tenant.limits
        if limits.max_running_requests is None and limits.max_queued_requests is None:
            return None
        running = limits.max_running_requests if limits.max_running_requests is not None else self.max_running
        queued = limits.max_queued_requests if limits.max_queued_requests is not None else self.max_queued
        return running + queued

    def admit(self, tenant: Tenant, num: int, param: str | None) -> None:
        """Count `num` engine requests against the tenant's limits, or raise 429 (over one now) or 400 (never fits)."""
        name, limits = tenant.name, tenant.limits
        cap = self.cap(tenant)
        if cap is not None:
            if num > cap:
                raise bad_request(f"the request asks for {num} generations but tenant {name!r} may have at most {cap} "
                                  "queued or running at once", param)
            if self.in_flight[name] + num > cap:
                self._refuse(name, "requests", f"{self.in_flight[name]} of its requests are queued or running "
                             f"(its limit: {cap})", RETRY_AFTER_S)
        if limits.tokens_per_minute is not None:
            wait = self._tokens_wait(name, limits.tokens_per_minute)
            if wait is not None:
                self._refuse(name, "tokens_per_minute", f"it used its {limits.tokens_per_minute} tokens per minute",
                             wait)
        if limits.max_kv_share is not None:
            held = self.engine.tenant_slots.get(name, 0)
            if held >= limits.max_kv_share * self.total_slots:
                self._refuse(name, "max_kv_share", f"its running requests hold {held} of the {self.total_slots} KV "
                             f"slots (its share: {limits.max_kv_share:g})", RETRY_AFTER_S)
        self.in_flight[name] += num

    def release(self, name: str, num: int) -> None:
        self.in_flight[name] -= num
        if self.in_flight[name] <= 0:
            del self.in_flight[name]

    def charge(self, name: str, tokens: int) -> None:
        """A finished request's prompt + completion tokens, for tokens_per_minute."""
        if tokens > 0:
            self._window.setdefault(name, deque()).append((self.clock(), tokens))

    def _tokens_wait(self, name: str, limit: int) -> int | None:
        """Whole seconds until the tenant's last minute holds fewer than `limit` tokens; None: it does now."""
        window = self._window.get(name)
        if not window:
            return None
        now = self.clock()
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        used = sum(tokens for _, tokens in window)
        if used < limit:
            return None
        for at, tokens in window:  # oldest first: the window drops below the limit when this entry ages out
            used -= tokens
            if used < limit:
                return max(1, math.ceil(at + WINDOW_S - now))
        return max(1, math.ceil(WINDOW_S))  # unreachable: used reaches 0 < limit

    def _refuse(self, name: str, limit: str, why: str, retry_after: int) -> None:
        self.refused[(name, limit)] += 1
        raise APIError(429, f"tenant {name!r} is over its limit: {why}; retry in {retry_after} s",
                       code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)})
