"""agent_trace's trace against an in-process Engine on a virtual clock: excess recompute as deterministic counts.

A dev tool for the retention and eviction rules of scheduler/sessions.py. The trace is bench/agent_trace.py's
(`make_plan`: the same seeded agents, apps, tool results and tool latencies); instead of a server and the wall
clock, an in-process `Engine` (the tiny bench model: outputs' values do not matter, only their lengths) steps on a
virtual clock. Each step advances it by a modelled step time (`StepModel`: a fixed cost plus a cost per token the
step computes; `STEP_COSTS` holds the costs measured for models S and L, `--costs`), or with `--wall-steps` by the
step's measured wall time (then `--model` should be the model whose latencies are wanted: the run is as slow as the
engine); tools take their trace latencies; when nothing runs the clock jumps to the next arrival. The
sessions' clock (pins, return gaps, pressure) and their prefill cost are the virtual ones, so a run's counts do not
depend on the machine or its load (except with --wall-steps). Per seed it calibrates the budget like agent_trace (the realised peak working set
of a run whose pool never evicts, sessions off), then per budget runs sessions on and off and replays each run's
realised trace through bench/cache_sim.py's LRU and Bélády at the engine's capacity. The target of issue 38:
excess(on) <= Bélády + 0.25 x (excess(off) - Bélády), Bélády on the sessions-on run's trace.

With `--config '{"tools": 4}' --name-tools` each turn calls one of four tools of different latencies and the engine
is told which (`Engine.settle_session(id, tool)`, as a chat `tool_calls` finish tells the server), and so is the
online yardstick. With `--warm-gaps` the engine starts with the return gaps of another trace of the same workload
(`warm_gaps`), as a server that served it before; else it learns them during the run.

    python -m radixserve.bench.agent_replay --seeds 0,1,2,3 --budgets 0.5,1.0
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from .agent_plan import TraceConfig, TurnRecord, make_plan, peak_working_set, simulated_excess
from .output import BenchOutput, bench_parser, parse_args, percentile


@dataclass(frozen=True)
class StepModel:
    """Virtual seconds per engine step: `base_s` + `per_token_s` x the tokens it computes (prefill and decode); with
    `wall`, the step's measured wall time instead (and the sessions measure their prefill cost themselves)."""
    base_s: float = 0.004
    per_token_s: float = 6e-5
    wall: bool = False

    def seconds(self, num_tokens: int) -> float:
        return self.base_s + self.per_token_s * num_tokens


# Step costs fitted to the engine's steps on the Intel Xeon of bench/results/*_xeon_* (2 cores, one engine thread):
# model S decodes ~7 running requests of ~2k context in 11-13 ms and computes a 512-token chunk at 2k context in
# 73-92 ms; model L's from its agent-trace runs. With S's costs the replay's turn p50 / p99 land within ~10% of
# agent_trace's over HTTP (bench/results/agent_replay_S_p99_xeon_s43.md); "fast" is the historic default.
STEP_COSTS = {"fast": StepModel(), "S": StepModel(0.010, 1.45e-4), "L": StepModel(0.05, 1.06e-3)}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(model_path: str, cfg: TraceConfig, kv_tokens: int, clock: _Clock, step: StepModel,
            admitted_at: dict[str, float], sessions: bool, engine_config: dict[str, Any] | None = None) -> Any:
    """An Engine as agent_trace's server runs it (sessions off: its agent cache off too), its sessions on the virtual
    clock, admissions time-stamped."""
    from ..scheduler.engine import Engine

    engine = Engine(model_path, kv_cache_tokens=kv_tokens, context_length=cfg.max_sequence(),
                    max_running_requests=min(cfg.agents, 64), num_threads=1, disable_agent_cache=not sessions,
                    **(engine_config or {}))
    sessions = engine.kv.sessions
    sessions._clock = clock
    if not step.wall:
        measured = sessions.observe_prefill
        sessions.observe_prefill = lambda n, _s: measured(n, step.seconds(n))  # the model's cost, not the machine's
    schedule = engine.planner.schedule

    def stamped(step_index: int):
        batch, admitted = schedule(step_index)
        for req in admitted:
            admitted_at[req.rid] = clock.now
        return batch, admitted

    engine.planner.schedule = stamped
    return engine


def run(model_path: str, cfg: TraceConfig, kv_tokens: int, sessions: bool,
        step: StepModel = StepModel(), name_tools: bool = False, warm: bool = False,
        engine_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run of the trace; returns the counts, the busy fraction over the arrivals and the realised records. With
    `name_tools` the engine is told which tool each turn called, as a chat turn's `tool_calls` tells the server."""
    clock, admitted_at = _Clock(), {}
    engine = _engine(model_path, cfg, kv_tokens, clock, step, admitted_at, sessions, engine_config)
    if warm:
        warm_gaps(engine.kv.sessions.gaps, cfg, name_tools)
    apps, plans = make_plan(cfg)
    due = [(p.arrival_s, p.index, 0) for p in plans]  # (time, agent, turn)
    heapq.heapify(due)
    history = {p.index: apps[p.app] + p.user for p in plans}
    cold = {p.index: len(p.user) + (len(apps[p.app]) if p.index < cfg.apps else 0) for p in plans}  # app: first use
    sent: dict[str, tuple[int, int, float]] = {}  # rid -> (agent, turn, send time)
    records: list[TurnRecord] = []
    busy = busy_arrivals = 0.0
    last_arrival = plans[-1].arrival_s
    while due or engine.has_unfinished():
        while due and due[0][0] <= clock.now:
            _, agent, turn = heapq.heappop(due)
            last = turn == cfg.turns - 1
            params = {"max_new_tokens": cfg.answer_tokens if last else cfg.call_tokens, "temperature": 0.0,
                      "ignore_eos": True, "session_id": f"agent-{cfg.seed}-{agent}" if sessions else None}
            rid = engine.add_request(history[agent], params, rid=f"{agent}-{turn}")
            sent[rid] = (agent, turn, clock.now)
        if not engine.has_unfinished():
            clock.now = due[0][0]
            continue
        before = engine.metrics.num_forward_tokens
        started = time.perf_counter()
        deltas = engine.step()
        took = time.perf_counter() - started if step.wall else step.seconds(engine.metrics.num_forward_tokens - before)
        busy += took
        busy_arrivals += max(min(clock.now + took, last_arrival) - clock.now, 0.0)
        clock.now += took
        for delta in deltas:
            if delta.finished:
                _finished(engine, cfg, plans, delta.result, sent.pop(delta.rid), clock.now, admitted_at, history,
                          cold, records, due, sessions, name_tools)
    pins = engine.kv.sessions.stats() | engine.kv.swap_stats()
    engine.shutdown()
    return {"records": records, "kv_tokens": engine.kv.total_slots, "busy_s": busy,
            "busy_arrivals": busy_arrivals / last_arrival, "end_s": clock.now, "pins": pins}


def _finished(engine, cfg, plans, result, sent, now, admitted_at, history, cold, records, due, sessions,
              name_tools) -> None:
    """A turn ended: record it (agent_trace's TurnRecord), and schedule the agent's next turn after its tool."""
    agent, turn, sent_s = sent
    sid, last = f"agent-{cfg.seed}-{agent}", turn == cfg.turns - 1
    queue_s = admitted_at.pop(result.rid, sent_s) - sent_s
    called = plans[agent].tools[turn] if name_tools and not last else None
    records.append(TurnRecord(agent, turn, result.prompt_tokens, result.cached_tokens, cold[agent], now - sent_s,
                              sent_s, history[agent], list(result.output_ids), queue_s, called))
    history[agent] = history[agent] + list(result.output_ids)
    if last:
        if sessions:
            engine.close_session(sid)
        return
    if sessions and called is not None:
        engine.settle_session(sid, tool_name(called))
    tool = plans[agent].tool_results[turn]
    history[agent] = history[agent] + tool
    cold[agent] = len(tool) + 1  # the tool result, and the last output token (never computed)
    heapq.heappush(due, (now + plans[agent].waits_s[turn], agent, turn + 1))


WARM_SEED_OFFSET = 1000  # warm_gaps' trace: the same workload at seed + this


def tool_name(tool: int) -> str:
    """The name the engine is told for the trace's tool number `tool`."""
    return f"tool{tool}"


def warm_gaps(gaps: Any, cfg: TraceConfig, name_tools: bool) -> None:
    """Feed `gaps` (the engine's ToolGaps) the return gaps of another trace of the same workload (its plan at seed
    + WARM_SEED_OFFSET: each tool's latency, by tool when named), as a server that has served this workload
    before has observed them. A fresh engine learns the distribution during the run, from the short returns first;
    the online yardstick knows the run's whole distribution from the start."""
    other = dataclasses.replace(cfg, seed=cfg.seed + WARM_SEED_OFFSET)
    for plan in make_plan(other)[1]:
        for turn in range(other.turns - 1):
            gaps.add(plan.waits_s[turn], tool_name(plan.tools[turn]) if name_tools else None)


def counts(out: dict[str, Any], sim: bool = True) -> dict[str, Any]:
    """Excess recompute (recomputed - cold) of a run, and the yardsticks' on its realised trace."""
    records = out["records"]
    recomputed = sum(r.prompt_tokens - r.cached_tokens for r in records)
    latencies = [r.latency_s for r in records]
    row = {"excess": recomputed - sum(r.cold_tokens for r in records), "busy_arrivals": round(out["busy_arrivals"], 3),
           "turn_p50_s": round(percentile(latencies, 50), 3), "turn_p99_s": round(percentile(latencies, 99), 3),
           "pins": {k: v for k, v in out["pins"].items()
                    if k.startswith(("num_pins_", "swap_")) or k == "num_tool_returns"}}
    if sim:
        replay = simulated_excess(records, out["kv_tokens"])
        row |= {"lru_sim": replay["lru"], "online_sim": replay["online"], "belady_sim": replay["belady"]}
    return row


def seed_rows(model_path: str, cfg: TraceConfig, budgets: Sequence[float], step: StepModel,
              name_tools: bool = False, warm: bool = False,
              engine_config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per budget: sessions on and off, and whether on meets the target (closes 75% of off's gap to Bélády)."""
    peak = peak_working_set(run(model_path, cfg, cfg.upper_bound(), False, step)["records"], cfg)
    rows = []
    for budget in budgets:
        kv_tokens = max(int(budget * peak), cfg.max_sequence() + cfg.answer_tokens)
        on = counts(run(model_path, cfg, kv_tokens, True, step, name_tools, warm, engine_config))
        off = counts(run(model_path, cfg, kv_tokens, False, step, name_tools))
        target = on["belady_sim"] + 0.25 * (off["excess"] - on["belady_sim"])
        rows.append({"seed": cfg.seed, "budget": budget, "peak": peak, "kv_tokens": kv_tokens, "on": on, "off": off,
                     "target": target, "meets": on["excess"] <= target})
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    from .harness import bench_model_path

    p = bench_parser("agent_replay", __doc__)
    p.add_argument("--model", default="tiny", help="bench model (its outputs' lengths are all that matter)")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2, 3])
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0])
    p.add_argument("--agents", type=int, default=48)
    p.add_argument("--arrivals-per-s", type=float, default=4.5)
    p.add_argument("--costs", choices=sorted(STEP_COSTS), default="fast",
                   help="a measured model's step costs (STEP_COSTS); --step-base-s / --step-per-token-s override")
    p.add_argument("--step-base-s", type=float)
    p.add_argument("--step-per-token-s", type=float)
    p.add_argument("--wall-steps", action="store_true",
                   help="advance the clock by each step's measured wall time (use the model of interest)")
    p.add_argument("--config", type=json.loads, default={}, help="other TraceConfig fields, as JSON")
    p.add_argument("--engine-config", type=json.loads, default={},
                   help="Engine options of the sessions-on runs, as JSON (e.g. '{\"kv_swap_space\": 4}')")
    p.add_argument("--name-tools", action="store_true",
                   help="tell the engine (and the online yardstick) which tool each turn called, as chat does")
    p.add_argument("--warm-gaps", action="store_true",
                   help="start the engine with the return gaps of another trace of the same workload (warm_gaps)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="write one report of these runs' agent_replay.json "
                   "(seeds run in parallel processes) instead of running")
    args = parse_args(p, argv)
    if args.merge:
        rows = merge(args.merge)
        _write(args, rows)
        return rows
    given = {"base_s": args.step_base_s, "per_token_s": args.step_per_token_s}
    step = dataclasses.replace(STEP_COSTS[args.costs], wall=args.wall_steps,
                               **{name: value for name, value in given.items() if value is not None})
    model_path = bench_model_path(args.model)
    rows = []
    for seed in args.seeds:
        cfg = TraceConfig(agents=args.agents, arrivals_per_s=args.arrivals_per_s, seed=seed, **args.config)
        for row in seed_rows(model_path, cfg, args.budgets, step, args.name_tools, args.warm_gaps,
                             args.engine_config):
            rows.append(row)
            on, off = row["on"], row["off"]
            print(f"seed {seed} budget {row['budget']:g} ({row['kv_tokens']} of peak {row['peak']}): excess on "
                  f"{on['excess']} off {off['excess']} | Bélády {on['belady_sim']} (off's trace "
                  f"{off['belady_sim']}) online sim {on['online_sim']} LRU sim {on['lru_sim']} | target "
                  f"{row['target']:.0f} "
                  f"{'meets' if row['meets'] else 'MISSES'} | busy {off['busy_arrivals']:.0%} | turn p50/p99 on "
                  f"{on['turn_p50_s']}/{on['turn_p99_s']} off {off['turn_p50_s']}/{off['turn_p99_s']} s | pins "
                  f"{on['pins']}",
                  flush=True)
    _write(args, rows)
    return rows


def _write(args: Any, rows: list[dict[str, Any]]) -> None:
    if args.out:
        out = BenchOutput("agent_replay", args.out)
        out.finish(out.write_report("agent_replay", {"command": args.command, "rows": rows}, markdown(rows)))


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Per seed and budget: the engine's excess with sessions on and off beside the three yardsticks replayed on
    the sessions-on run's trace, the issue's target, the share of off's gap to Bélády that on closes (`closed`,
    the target's 75%) and that the online yardstick closes of the LRU replay's; then per budget the medians."""
    lines = ["| seed | budget (tokens) | excess on | off | LRU sim | online sim | Bélády sim | target | closed | online "
             "closes | turn p99 on / off s | busy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        on, off = row["on"], row["off"]
        lines.append(f"| {row['seed']} | {row['budget']:g} ({row['kv_tokens']}) | {on['excess']} | {off['excess']} "
                     f"| {on['lru_sim']} | {on['online_sim']} | {on['belady_sim']} | {row['target']:.0f} "
                     f"({'met' if row['meets'] else 'missed'}) | {_closed(row)} | {_online_closes(row)} | "
                     f"{on['turn_p99_s']} / {off['turn_p99_s']} | {off['busy_arrivals']:.0%} |")
    lines.append("")
    for budget in sorted({row["budget"] for row in rows}):
        lines.append(_summary([row for row in rows if row["budget"] == budget]))
    return "\n".join(lines) + "\n"


def _share(gap_from: float, value: float, to: float) -> float | None:
    return (gap_from - value) / (gap_from - to) if gap_from != to else None


def _closed(row: dict[str, Any]) -> str:
    share = _share(row["off"]["excess"], row["on"]["excess"], row["on"]["belady_sim"])
    return "-" if share is None else f"{share:.0%}"


def _online_closes(row: dict[str, Any]) -> str:
    on = row["on"]
    share = _share(on["lru_sim"], on["online_sim"], on["belady_sim"])
    return "-" if share is None else f"{share:.0%}"


def _summary(rows: Sequence[dict[str, Any]]) -> str:
    """One budget's seeds: how many meet the target, and the target on the medians."""
    def med(values):
        return statistics.median(values)

    on, off = med([r["on"]["excess"] for r in rows]), med([r["off"]["excess"] for r in rows])
    belady = med([r["on"]["belady_sim"] for r in rows])
    target = belady + 0.25 * (off - belady)
    p99 = med([r["on"]["turn_p99_s"] / r["off"]["turn_p99_s"] for r in rows if r["off"]["turn_p99_s"]] or [0.0])
    return (f"Budget {rows[0]['budget']:g}: met on {sum(r['meets'] for r in rows)} of {len(rows)} seeds; on the "
            f"medians excess on {on:,.0f}, off {off:,.0f}, Bélády {belady:,.0f}, target {target:,.0f} "
            f"({'met' if on <= target else 'missed'}; closed {_share(off, on, belady) or 0:.0%}); turn p99 on / off "
            f"{p99:.2f}x (median of the seeds' ratios).")


def merge(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of several runs' agent_replay.json (seeds run in parallel processes), by seed and budget."""
    rows = [row for path in paths for row in json.loads(open(path).read())["rows"]]
    return sorted(rows, key=lambda row: (row["budget"], row["seed"]))


if __name__ == "__main__":
    main()
    sys.exit(0)
