"""Ordering of the waiting queue. The planner admits requests in the returned order.

Retracted requests always go first (they already streamed tokens and hold cached prefixes).
"""
from __future__ import annotations

from radixserve.scheduler.kv_ops import PrefixKV
from radixserve.scheduler.req import Req

POLICIES = ("fcfs", "lpm", "dfs-weight", "cache-aware")


class SchedulePolicy:
    def __init__(self, name: str, kv: PrefixKV):
        if name not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(POLICIES)}; got {name!r}")
        self.name = name
        self.kv = kv

    def order(self, waiting: list[Req], step: int) -> list[Req]:
        retracted = [r for r in waiting if r.num_retractions > 0]
        fresh = [r for r in waiting if r.num_retractions == 0]
        if self.name == "fcfs" or self.kv.tree.disable:
            return retracted + fresh
        # lpm and (until they get their own rules) dfs-weight / cache-aware: longest prefix first,
        # stable on arrival order.
        match = {id(r): self.kv.match_len(r) for r in fresh}
        fresh.sort(key=lambda r: -match[id(r)])
        return retracted + fresh
