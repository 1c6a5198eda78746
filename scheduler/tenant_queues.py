"""The waiting requests of each tenant, as the fair share sees them (scheduler/fair_share.py).

Kept up to date by the queue's changes (`join` when a request starts waiting: an arrival or a retraction; `leave`
when it stops: admission or abort), so a step reads the backlogged tenants, their queue lengths, their best
priority and their first requests without a pass over the whole queue: with thousands of one tenant's requests
waiting, a pass per step was most of a step of a small model (issue 41: the light tenant's wait grew with the heavy
one's backlog, as the steps did).
"""
from __future__ import annotations

from typing import Iterator

from .req import Req

DEFAULT_TENANT = "default"


def tenant_of(req: Req) -> str:
    return req.params.tenant or DEFAULT_TENANT


class TenantQueues:
    def __init__(self) -> None:
        self._fifo: dict[str, dict[int, Req]] = {}  # tenant -> id -> request, in the order they joined
        self._priorities: dict[str, dict[int, int]] = {}  # tenant -> priority -> requests waiting at it
        self._sessions: dict[str, int] = {}  # tenant -> its waiting requests with a session (a program)
        self._longest: dict[str, int] = {}  # tenant -> the longest prompt joined since its queue was last empty
        self._members: dict[int, str] = {}  # id -> tenant, for every waiting request
        self._not_plain = 0  # waiting requests at a priority other than 0 or with a session

    def join(self, req: Req) -> bool:
        """`req` starts waiting; True when its tenant's queue was empty (the tenant becomes backlogged)."""
        tenant = tenant_of(req)
        if id(req) in self._members:
            return False
        fifo = self._fifo.setdefault(tenant, {})
        fifo[id(req)] = req
        self._members[id(req)] = tenant
        p = req.params
        prios = self._priorities.setdefault(tenant, {})
        prios[p.priority] = prios.get(p.priority, 0) + 1
        session = p.session_id is not None
        self._sessions[tenant] = self._sessions.get(tenant, 0) + session
        self._not_plain += bool(p.priority) or session
        self._longest[tenant] = max(self._longest.get(tenant, 0), len(req.prompt_ids))
        return len(fifo) == 1

    def leave(self, req: Req) -> bool:
        """`req` stops waiting; True when its tenant's queue is now empty."""
        tenant = self._members.pop(id(req), None)
        if tenant is None:
            return False
        fifo = self._fifo[tenant]
        del fifo[id(req)]
        p = req.params
        prios = self._priorities[tenant]
        prios[p.priority] -= 1
        if not prios[p.priority]:
            del prios[p.priority]
        session = p.session_id is not None
        self._sessions[tenant] -= session
        self._not_plain -= bool(p.priority) or session
        if fifo:
            return False
        for table in (self._fifo, self._priorities, self._sessions, self._longest):
            del table[tenant]
        return True

    def __contains__(self, req: Req) -> bool:
        return id(req) in self._members

    def __len__(self) -> int:
        return len(self._members)

    def members(self) -> list[Req]:
        return [r for fifo in self._fifo.values() for r in fifo.values()]

    def tenants(self) -> list[str]:
        """The backlogged tenants (at least one request waiting)."""
        return list(self._fifo)

    def count(self, tenant: str) -> int:
        return len(self._fifo.get(tenant, ()))

    def best_priority(self, tenant: str) -> int:
        return min(self._priorities[tenant])

    def longest(self) -> int:
        """An upper bound on the longest prompt waiting (exact after each tenant's queue last emptied)."""
        return max(self._longest.values(), default=0)

    @property
    def plain(self) -> bool:
        """Every waiting request at priority 0 without a session: the order within a tenant is the policy's."""
        return not self._not_plain

    def fresh_in_join_order(self, tenant: str, skip: set[int]) -> Iterator[Req]:
        """The tenant's waiting requests never retracted and not in `skip`, in the order they joined (for fresh
        requests, the order of the planner's queue: arrivals are appended)."""
        return (r for r in self._fifo.get(tenant, {}).values() if not r.num_retractions and id(r) not in skip)
