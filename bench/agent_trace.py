"""Agents that pause: tool-calling agents against `radixserve serve`, with and without sessions, at KV budgets
smaller than the trace's working set.

N agents (in a few apps whose system prompt and tools are shared by their agents) arrive as a Poisson process.
Each runs several turns: the prompt is its whole history, the output a tool call of a few dozen tokens (the last
turn: the answer); between turns it waits a tool latency drawn from a lognormal (median and p95 are flags), then
appends a tool result of 100-400 tokens. Token-level and seeded: every request is `/generate` with `input_ids`,
each turn built from the previous turn's actual output ids. With sessions on, every request names its agent's
session (`session_params.id`) and the agent closes it after its last turn, so the server pins its history
while it waits (scheduler/sessions.py); off, the server runs with `--disable-agent-cache` (no pins, no look-ahead,
no program scheduling: issue 38's one flag) and the cache is plain LRU with reuse.

Per budget and mode it reports prompt tokens recomputed (prompt - cached), the **cold** tokens every cache must
compute (first-time tokens: an app's prompt the first time it is sent, each agent's first message, each tool
result, and the one token per turn no cache holds), the **excess** recompute (recomputed - cold), per-turn latency
(send to the turn's last token) and agent completion time p50/p99, throughput, the server's busy fraction (its
engine's step time over the run's wall time, and over the arrivals: until the last agent arrives, before the drain
of the slowest tools dilutes it), the server's pin counters, the slowest 1% of turns with their time queued in
the engine (where a p99 comes from: waiting for memory or the order, or computing), and the excess of three
yardsticks replayed on each run's realised trace at the same capacity (bench/cache_sim.py): an LRU cache,
Bélády's (evict what is next used furthest away) and the online one (Bélády's rule on what a server can know
then).
Budgets are fractions of the trace's peak working set: the most tokens its live histories and their apps'
prompts held at once on the realised timeline of a calibration run with a pool that never evicts
(`peak_working_set`). Every repetition is another seed (another trace), calibrated on its own. The modes
alternate per budget on fresh servers.
KV dtypes (`--kv-cache-dtypes auto,int8`) compare at the same KV memory: a budget's tokens are priced in the bytes of
the model's dtype (the dtype the server runs in), and each KV dtype's pool holds as many tokens as those bytes hold
in it (kernels/kv_budget.py's row sizes: an int8 pool ~1.9x a bf16 one's). `--sessions on` runs one mode only.

    python -m radixserve.bench.agent_trace --model S --budgets 0.25,0.5,1.0 --repeats 3
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import time
from typing import Any, Awaitable, Callable, Sequence

import httpx

from ..kernels.kv_budget import KV_CACHE_DTYPES, kv_bytes_per_token
from ..scheduler.config import DTYPES
from .agent_plan import (TraceConfig, TurnRecord, make_plan, peak_working_set, queued_share, simulated_excess,
                         tail_turns)
from .cache_sim import POLICIES
from .kv_memory import kv_shape, pool_tokens
from .output import BenchOutput, bench_parser, comma_choices, parse_args, percentile
from .plot import plot_agent_trace


async def send_generate(client: httpx.AsyncClient, history: list[int], max_tokens: int,
                        session: str | None) -> tuple[int, int, list[int], float | None]:
    """One turn through radixserve's /generate: (prompt tokens, cached tokens, output ids, time queued in the
    engine)."""
    body: dict[str, Any] = {"input_ids": history, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    if session is not None:
        body["session_params"] = {"id": session}
    response = await client.post("/generate", json=body)
    response.raise_for_status()
    out = response.json()
    meta = out["meta_info"]
    return meta["prompt_tokens"], meta["cached_tokens"], list(out["output_ids"]), meta.get("queue_time")


async def run_agent(client: httpx.AsyncClient, cfg: TraceConfig, app: list[int], plan: AgentPlan,
                    sessions: bool, apps_sent: set[int], records: list[TurnRecord],
                    send: Callable[..., Awaitable[tuple[int, int, list[int]]]] = send_generate) -> float:
    """One agent's turns; returns its completion time (arrival to its answer's last token)."""
    await asyncio.sleep(plan.arrival_s)
    start = time.monotonic()
    sid = f"agent-{cfg.seed}-{plan.index}"
    history = app + plan.user
    cold = len(plan.user) + (0 if plan.app in apps_sent else len(app))
    apps_sent.add(plan.app)
    for turn in range(cfg.turns):
        last = turn == cfg.turns - 1
        sent = time.monotonic()
        prompt_tokens, cached, output_ids, *queued = await send(
            client, history, cfg.answer_tokens if last else cfg.call_tokens, sid if sessions else None)
        records.append(TurnRecord(plan.index, turn, prompt_tokens, cached, cold, time.monotonic() - sent, sent,
                                  history, output_ids, queued[0] if queued else None))
        history = history + output_ids
        if last:
            break
        await asyncio.sleep(plan.waits_s[turn])
        history = history + plan.tool_results[turn]
        cold = len(plan.tool_results[turn]) + 1  # the tool result, and the last output token (never computed)
    if sessions:
        await client.post("/close_session", json={"session_id": sid})
    return time.monotonic() - start


async def run_trace(url: str, cfg: TraceConfig, sessions: bool, kv_tokens: int,
                    send: Callable[..., Awaitable[tuple[int, int, list[int]]]] = send_generate,
                    server_stats: bool = True) -> dict[str, Any]:
    """The whole trace against one server; `server_stats`: it answers /get_server_info (radixserve), so its busy
    fraction and pin counters are reported."""
    apps, agents = make_plan(cfg)
    records: list[TurnRecord] = []
    apps_sent: set[int] = set()
    limits = httpx.Limits(max_connections=cfg.agents + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        read = (lambda: _stats(client)) if server_stats else None
        before = await read() if read else {}
        start = time.monotonic()
        work = asyncio.gather(*(run_agent(client, cfg, apps[a.app], a, sessions, apps_sent, records, send)
                                for a in agents))
        at_last_arrival = asyncio.create_task(_stats_at(read, agents[-1].arrival_s)) if read else None
        done = await work
        wall = time.monotonic() - start
        stats = await read() if read else {}
        window = await at_last_arrival if at_last_arrival else None
    busy = busy_arrivals = None
    if server_stats and wall:
        busy = (stats["step_time_s"] - before["step_time_s"]) / wall
        busy_arrivals = (window["step_time_s"] - before["step_time_s"]) / agents[-1].arrival_s
    return summarize(records, done, wall, stats) | {"busy": busy, "busy_arrivals": busy_arrivals,
                                                    "peak_tokens": peak_working_set(records, cfg),
                                                    "sim": simulated_excess(records, kv_tokens)}


async def _stats(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/get_server_info")).json()["stats"]


async def _stats_at(read: Callable[[], Awaitable[dict[str, Any]]], at_s: float) -> dict[str, Any]:
    """The server's counters when the last agent arrives: the busy fraction of the offered-load window, before
    the drain (the slowest tools' agents alone) dilutes it."""
    await asyncio.sleep(at_s)
    return await read()


def summarize(records: Sequence[TurnRecord], completions: Sequence[float], wall_s: float,
              stats: dict[str, Any]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    cold = sum(r.cold_tokens for r in records)
    latencies = [r.latency_s for r in records]
    tail = tail_turns(records)
    return {"turns": len(records), "prompt_tokens": prompt, "cached_tokens": cached, "recomputed": prompt - cached,
            "cold": cold, "excess": prompt - cached - cold,
            "turn_p50_s": percentile(latencies, 50), "turn_p99_s": percentile(latencies, 99),
            "agent_p50_s": percentile(completions, 50), "agent_p99_s": percentile(completions, 99),
            "tail": tail, "tail_queued": queued_share(tail),  # the slowest 1% of turns, and their time queued
            "wall_s": wall_s, "turns_per_s": len(records) / wall_s if wall_s else 0.0,
            "pool_slots": stats.get("total_slots"),  # the server's KV pool (None: a peer's, unknown)
            "pins": {k: stats.get(k, 0) for k in ("num_pins_pinned", "num_pins_used", "num_pins_expired",
                                                   "num_pins_reclaimed", "num_pins_settled", "num_starts_held",
                                                   "swap_saved", "swap_restored", "swap_peak_tokens",
                                                   "swap_bytes_per_token")}}


def server_args(model_path: str, cfg: TraceConfig, kv_tokens: int, threads: int, dtype: str = "auto",
                kv_cache_dtype: str = "auto") -> list[str]:
    return ["--model", model_path, "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype, "--kv-cache-tokens",
            str(kv_tokens), "--num-threads", str(threads), "--context-length", str(cfg.max_sequence()),
            "--max-running-requests", str(min(cfg.agents, 64)), "--max-queued-requests", str(4 * cfg.agents),
            "--disable-log-requests"]


def run_budget(model_path: str, cfg: TraceConfig, kv_tokens: int, sessions: bool, threads: int, dtype: str = "auto",
               kv_cache_dtype: str = "auto", env: dict[str, str] | None = None,
               admission_ratio: float | None = None, swap_space: float = 0.0) -> dict[str, Any]:
    """One run on a fresh server; `admission_ratio`: its load control of sessions (sessions on only; None: its
    default, 0: off); `swap_space`: GiB of its session swap tier on disk (sessions on only; 0: none)."""
    from ..frontend.spawn import ServerProcess

    args = server_args(model_path, cfg, kv_tokens, threads, dtype, kv_cache_dtype)
    if sessions and admission_ratio is not None:
        args += ["--session-admission-ratio", str(admission_ratio)]
    if sessions and swap_space:
        args += ["--kv-swap-space", str(swap_space)]
    server = ServerProcess(args + ([] if sessions else ["--disable-agent-cache"]), env=env)
    try:
        return asyncio.run(run_trace(server.url, cfg, sessions, kv_tokens))
    finally:
        server.stop()


def calibrate(model_path: str, cfg: TraceConfig, threads: int, dtype: str = "auto",
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """The calibration run: a pool that never evicts, sessions off; its realised peak (`peak_tokens`) is the working
    set the budgets are fractions of."""
    return run_budget(model_path, cfg, cfg.upper_bound(), False, threads, dtype, env=env)


def run_order(kv_cache_dtypes: Sequence[str], sessions: Sequence[bool], flip: bool) -> list[tuple[str, bool]]:
    """The (KV dtype, sessions) runs of one budget; `flip` reverses them, so the first alternates."""
    runs = [(kv, on) for kv in kv_cache_dtypes for on in sessions]
    return runs[::-1] if flip else runs


def medians(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (budget, KV dtype, sessions): the median of each measure over the repetitions."""
    def key(r):
        return r["budget"], r.get("kv_cache_dtype", "auto"), r["sessions"]

    rows = []
    for k in dict.fromkeys(map(key, runs)):
        mine = [r for r in runs if key(r) == k]
        row = {k: v for k, v in mine[0].items() if k not in ("rep", "pins", "sim", "tail")}  # the tails: in runs
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("budget", "seed"):
                row[k] = statistics.median(r[k] for r in mine if r[k] is not None)
        for nested in ("pins", "sim"):
            row[nested] = {k: statistics.median(r[nested][k] for r in mine) for k in mine[0][nested]}
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"# Agent trace: model {report['model']}, {cfg['agents']} agents, {cfg['turns']} turns", "",
             f"`{report['command']}`", "",
             f"{cfg['apps']} apps of {cfg['app_tokens']} tokens; tool results {cfg['tool_tokens']} tokens; tool "
             f"latency lognormal, median {cfg['tool_median_s']} s, p95 {cfg['tool_p95_s']} s; arrivals "
             f"{cfg['arrivals_per_s']}/s. Peak working set {report['working_set']:g} tokens (median; per seed "
             f"{', '.join(str(p) for p in report['peaks'])}: the calibration runs' realised peaks, which the budgets "
             "are fractions of). Greedy, ignore_eos; sessions on: each request names its agent's session, closed "
             "after its last turn. Excess = recomputed - cold (first-time tokens). Each row: the median over "
             f"{report['repeats']} seed(s), the modes alternating on fresh servers. KV budget: its memory (the "
             "model's dtype's bytes of its share of the working set); each KV dtype's pool holds the tokens "
             "that memory holds in it." + _swap_note(report.get("kv_swap_space", 0)), "",
             "| KV budget (MiB) | KV dtype | tokens held | sessions | recomputed | cold | excess | turn p50 / p99 s "
             "| agent p50 / p99 s | turns/s | busy (arrivals) | pins used / reclaimed / expired, starts held "
             "| restored | excess: LRU / online / Bélády sim |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        p = row["pins"]
        lines.append(f"| {row['budget']:g} ({row['kv_bytes'] / 2**20:.3g}) | {row['kv_cache_dtype']} "
                     f"| {row['kv_tokens']:g} | {'on' if row['sessions'] else 'off'} "
                     f"| {row['recomputed']:g} | {row['cold']:g} | {row['excess']:g} "
                     f"| {row['turn_p50_s']:.2f} / {row['turn_p99_s']:.2f} | {row['agent_p50_s']:.1f} / "
                     f"{row['agent_p99_s']:.1f} | {row['turns_per_s']:.2f} "
                     f"| {row['busy']:.0%} ({row['busy_arrivals']:.0%}) | {p['num_pins_used']:g} / "
                     f"{p['num_pins_reclaimed']:g} / {p['num_pins_expired']:g}, {p['num_starts_held']:g} "
                     f"| {p.get('swap_restored', 0):g} "
                     f"| {' / '.join(format(row['sim'][policy], 'g') for policy in POLICIES)}"
                     f"{_overflow(row['sim'])} |")
    return "\n".join(lines + _tail_lines(report["rows"])) + "\n"


def _tail_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where the slowest turns' time went (each run's slowest 1%; the runs' records: the JSON)."""
    shares = [f"{row['budget']:g} {row['kv_cache_dtype']} {'on' if row['sessions'] else 'off'}: "
              f"{row['tail_queued']:.0%}" for row in rows if row.get("tail_queued") is not None]
    return ["", "The slowest turns (each run's slowest 1%, at least one; the JSON's runs list them): the share of "
            "their latency spent queued in the engine (arrival to admission), the median over the seeds: "
            + "; ".join(shares) + "."] if shares else []


def _swap_note(swap_space: float) -> str:
    return (f" Sessions on: the server's session swap tier holds up to {swap_space:g} GiB on disk "
            "(`--kv-swap-space`); restored = prompt tokens read back from it (counted as cached: not recomputed), "
            "besides the KV budget." if swap_space else "")


def _overflow(sim: dict[str, float]) -> str:
    """The replays' honesty: requests that waited for room (the server had admitted them earlier: its decode-room
    estimate, retraction), and tokens over the capacity (a request larger than the cache)."""
    waited = max(sim.get(f"{policy}_deferred", 0) for policy in POLICIES)
    over = max(sim.get(f"{policy}_overflow", 0) for policy in POLICIES)
    return (f" (waited: {waited:g} requests)" if waited else "") + (f" (over capacity by {over:g})" if over else "")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from .harness import bench_model_path

    args = _parse(argv)
    cfg = TraceConfig(agents=args.agents, apps=args.apps, app_tokens=args.app_tokens, turns=args.turns,
                      user_tokens=args.user_tokens, call_tokens=args.call_tokens, answer_tokens=args.answer_tokens,
                      tool_tokens=tuple(args.tool_tokens), arrivals_per_s=args.arrivals_per_s,
                      tool_median_s=args.tool_median_s, tool_p95_s=args.tool_p95_s, vocab=args.vocab,
                      seed=args.seed)
    model_path = bench_model_path(args.model)
    shape = kv_shape(model_path, args.dtype)
    runs, peaks = [], []
    for rep in range(args.repeats):
        seeded = dataclasses.replace(cfg, seed=cfg.seed + rep)
        peaks.append(calibrate(model_path, seeded, args.threads, args.dtype)["peak_tokens"])
        for i, budget in enumerate(args.budgets):
            model_tokens = max(int(budget * peaks[-1]), cfg.max_sequence() + cfg.answer_tokens)
            for kv_dtype, sessions in run_order(args.kv_cache_dtypes, args.sessions, (i + rep) % 2 == 1):
                kv_tokens = pool_tokens(model_tokens, shape, kv_dtype)
                row = run_budget(model_path, seeded, kv_tokens, sessions, args.threads, args.dtype, kv_dtype,
                                 admission_ratio=args.session_admission_ratio, swap_space=args.kv_swap_space)
                runs.append({"rep": rep, "seed": seeded.seed, "budget": budget, "kv_cache_dtype": kv_dtype,
                             "kv_tokens": kv_tokens, "kv_bytes": model_tokens * kv_bytes_per_token(*shape),
                             "sessions": sessions, **row})
    report = {"bench": "agent_trace", "command": args.command, "model": args.model, "repeats": args.repeats,
              "kv_swap_space": args.kv_swap_space,
              "config": dataclasses.asdict(cfg), "working_set": statistics.median(peaks), "peaks": peaks,
              "rows": medians(runs), "runs": runs}
    out = BenchOutput("agent_trace", args.out)
    title = f"Agent trace, model {args.model}: medians of {args.repeats}"
    draw = lambda path: plot_agent_trace(report["rows"], path, title)  # noqa: E731
    out.finish(out.write_report(f"agent_trace_{args.model}", report, markdown(report), draw=draw))
    return report


def _parse(argv: Sequence[str] | None) -> Any:
    d = TraceConfig()
    p = bench_parser("agent_trace", __doc__)
    p.add_argument("--model", default="S", help="bench model (S, M, L), a checkpoint directory or a config.json")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 1.0],
                   help="KV budgets as fractions of the trace's working set")
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--apps", type=int, default=d.apps)
    p.add_argument("--app-tokens", type=int, default=d.app_tokens)
    p.add_argument("--user-tokens", type=int, default=d.user_tokens)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--call-tokens", type=int, default=d.call_tokens)
    p.add_argument("--answer-tokens", type=int, default=d.answer_tokens)
    p.add_argument("--tool-tokens", type=int, nargs=2, default=list(d.tool_tokens), metavar=("MIN", "MAX"))
    p.add_argument("--arrivals-per-s", type=float, default=d.arrivals_per_s)
    p.add_argument("--tool-median-s", type=float, default=d.tool_median_s)
    p.add_argument("--tool-p95-s", type=float, default=d.tool_p95_s)
    p.add_argument("--vocab", type=int, default=d.vocab, help="token ids are drawn below this")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server's engine")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="the server's --dtype")
    p.add_argument("--kv-cache-dtypes", type=comma_choices(KV_CACHE_DTYPES), default=["auto"],
                   help="KV cache dtypes to run, each at the budget's memory in the model's dtype")
    p.add_argument("--sessions", type=comma_choices(("on", "off")), default=["on", "off"],
                   help="the modes: sessions on, off (plain LRU)")
    p.add_argument("--repeats", type=int, default=3, help="runs per budget and mode; each row is their median")
    p.add_argument("--session-admission-ratio", type=float, default=None,
                   help="the server's --session-admission-ratio with sessions on (default: the server's; 0: off)")
    p.add_argument("--kv-swap-space", type=float, default=0.0,
                   help="the server's --kv-swap-space (GiB of disk for the session swap tier) with sessions on")
    p.add_argument("--seed", type=int, default=d.seed)
    args = parse_args(p, argv)
    args.sessions = [mode == "on" for mode in args.sessions]
    return args


if __name__ == "__main__":
    main()
    sys.exit(0)
