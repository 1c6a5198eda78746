"""The demo model's weather agent over `/v1/chat/completions` with tools, beside traffic that churns the cache:
real `tool_calls` finishes, sessions on and off.

Each agent asks the weather of a city with the `get_weather` tool offered; the model answers with a tool call
(`finish_reason: tool_calls`); the agent waits a tool latency (lognormal, median and p95 are flags), appends the
tool's result and asks again, and the model answers in words. With sessions on, both turns name the agent's
session (`x-session-id`), so the server pins the history when the first turn ends in a tool call
(scheduler/sessions.py); off, the cache is plain LRU with reuse. Meanwhile `--fillers` clients send chat
requests of distinct text that push old paths out of a KV pool sized for a few histories.

Per mode it reports the second turn's prompt tokens and how many were cached (the history the pin kept), the
tool-call finishes, the second turn's latency p50/p99, the fillers' requests served and the server's pin counters.
Figures to quote, no target: the agent-trace bench (bench/agent_trace.py) measures recompute at scale.

    python -m radixserve.bench.agent_chat --agents 24 --repeats 3
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from .demo_kit.eval_cases import WEATHER_TOOL
from .output import BenchOutput, bench_parser, parse_args, percentile

MODEL = "radixserve-demo"
CITIES = ("Paris", "Tokyo", "Berlin", "Madrid", "Rome", "London", "Cairo", "Lima")
WORDS = ("river", "stone", "garden", "window", "paper", "music", "silver", "forest", "market", "engine",
         "cloud", "letter", "bridge", "summer", "candle", "harbor")
PIN_KEYS = ("num_pins_pinned", "num_pins_used", "num_pins_expired", "num_pins_reclaimed", "num_pins_settled",
            "num_tool_returns")


@dataclass(frozen=True)
class ChatTraceConfig:
    agents: int = 24
    arrivals_per_s: float = 2.0
    tool_median_s: float = 1.0
    tool_p95_s: float = 10.0
    fillers: int = 2  # clients sending churn traffic while agents run
    filler_words: int = 60
    kv_tokens: int = 1536
    seed: int = 0


def _tool_wait(rng: random.Random, cfg: ChatTraceConfig) -> float:
    sigma = math.log(cfg.tool_p95_s / cfg.tool_median_s) / 1.6449  # p95 of a lognormal = median * e^(1.645 sigma)
    return rng.lognormvariate(math.log(cfg.tool_median_s), sigma)


async def _chat(client: httpx.AsyncClient, messages: list[dict], headers: dict, **extra: Any) -> tuple[dict, float]:
    start = time.monotonic()
    r = await client.post("/v1/chat/completions", headers=headers,
                          json={"model": MODEL, "messages": messages, "temperature": 0, **extra})
    r.raise_for_status()
    return r.json(), time.monotonic() - start


async def run_agent(client: httpx.AsyncClient, i: int, arrival_s: float, wait_s: float, sessions: bool,
                    records: list[dict]) -> None:
    await asyncio.sleep(arrival_s)
    city = CITIES[i % len(CITIES)]
    headers = {"x-session-id": f"agent-{i}"} if sessions else {}
    messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
    first, _ = await _chat(client, messages, headers, tools=[WEATHER_TOOL])
    choice = first["choices"][0]
    record = {"agent": i, "finish": choice["finish_reason"]}
    records.append(record)
    if choice["finish_reason"] != "tool_calls":
        return
    await asyncio.sleep(wait_s)
    call = choice["message"]["tool_calls"][0]
    messages += [choice["message"], {"role": "tool", "tool_call_id": call["id"],
                                     "content": json.dumps({"temperature": 10 + i % 20, "condition": "windy"})}]
    second, latency = await _chat(client, messages, headers, tools=[WEATHER_TOOL])
    usage = second["usage"]
    record.update(prompt=usage["prompt_tokens"], cached=usage["prompt_tokens_details"]["cached_tokens"],
                  latency_s=latency, answer=second["choices"][0]["finish_reason"])


async def run_filler(client: httpx.AsyncClient, k: int, cfg: ChatTraceConfig, stop: asyncio.Event,
                     served: list[int]) -> None:
    rng = random.Random(cfg.seed * 1000 + k)
    while not stop.is_set():
        text = " ".join(rng.choice(WORDS) for _ in range(cfg.filler_words))
        await _chat(client, [{"role": "user", "content": text}], {}, max_tokens=4)
        served[k] += 1


async def run_mode(url: str, cfg: ChatTraceConfig, sessions: bool) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    arrivals, t = [], 0.0
    for _ in range(cfg.agents):
        t += rng.expovariate(cfg.arrivals_per_s)
        arrivals.append(t)
    waits = [_tool_wait(rng, cfg) for _ in range(cfg.agents)]
    records: list[dict] = []
    served = [0] * cfg.fillers
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        before = (await client.get("/get_server_info")).json()["stats"]
        fillers = [asyncio.create_task(run_filler(client, k, cfg, stop, served)) for k in range(cfg.fillers)]
        await asyncio.gather(*(run_agent(client, i, arrivals[i], waits[i], sessions, records)
                               for i in range(cfg.agents)))
        stop.set()
        await asyncio.gather(*fillers)
        after = (await client.get("/get_server_info")).json()["stats"]
    return summarize(records, sum(served), {k: after.get(k, 0) - before.get(k, 0) for k in PIN_KEYS})


def summarize(records: Sequence[dict], filler_requests: int, pins: dict[str, int]) -> dict[str, Any]:
    second = [r for r in records if "prompt" in r]
    prompt = sum(r["prompt"] for r in second)
    cached = sum(r["cached"] for r in second)
    latencies = [r["latency_s"] for r in second]
    return {"agents": len(records), "tool_calls": sum(r["finish"] == "tool_calls" for r in records),
            "answers": sum(r.get("answer") == "stop" for r in second),
            "second_prompt_tokens": prompt, "second_cached_tokens": cached,
            "second_hit": cached / prompt if prompt else 0.0,
            "second_p50_s": percentile(latencies, 50), "second_p99_s": percentile(latencies, 99),
            "filler_requests": filler_requests, "pins": pins}


def run_server(cfg: ChatTraceConfig, sessions: bool, threads: int) -> dict[str, Any]:
    from ..frontend.spawn import ServerProcess

    server = ServerProcess(["--kv-cache-tokens", str(cfg.kv_tokens), "--num-threads", str(threads),
                            "--disable-log-requests"])
    try:
        return asyncio.run(run_mode(server.url, cfg, sessions))
    finally:
        server.stop()


def medians(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for sessions in (True, False):
        mine = [r for r in runs if r["sessions"] == sessions]
        row: dict[str, Any] = {"sessions": sessions}
        for k, v in mine[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "rep":
                row[k] = statistics.median(r[k] for r in mine)
        row["pins"] = {k: statistics.median(r["pins"][k] for r in mine) for k in PIN_KEYS}
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"# Weather agents over chat completions (demo model, {cfg['agents']} agents)", "",
             f"`{report['command']}`", "",
             f"Agents arrive at {cfg['arrivals_per_s']}/s; tool latency lognormal, median {cfg['tool_median_s']} s, "
             f"p95 {cfg['tool_p95_s']} s; {cfg['fillers']} filler clients churn a {cfg['kv_tokens']}-token KV pool. "
             f"Each row: the median of {report['repeats']} run(s), the modes alternating on fresh servers.", "",
             "| sessions | tool_calls finishes | answers | 2nd turn cached / prompt tokens | 2nd turn hit | "
             "2nd turn p50 / p99 s | filler requests | pins used / reclaimed / expired |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        p = r["pins"]
        lines.append(f"| {'on' if r['sessions'] else 'off'} | {r['tool_calls']:g} of {r['agents']:g} | "
                     f"{r['answers']:g} | {r['second_cached_tokens']:g} / {r['second_prompt_tokens']:g} | "
                     f"{r['second_hit']:.2f} | {r['second_p50_s']:.2f} / {r['second_p99_s']:.2f} | "
                     f"{r['filler_requests']:g} | {p['num_pins_used']:g} / {p['num_pins_reclaimed']:g} / "
                     f"{p['num_pins_expired']:g} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    cfg = ChatTraceConfig(agents=args.agents, arrivals_per_s=args.arrivals_per_s, tool_median_s=args.tool_median_s,
                          tool_p95_s=args.tool_p95_s, fillers=args.fillers, filler_words=args.filler_words,
                          kv_tokens=args.kv_cache_tokens, seed=args.seed)
    runs = []
    for rep in range(args.repeats):
        for sessions in ((True, False) if rep % 2 == 0 else (False, True)):
            runs.append({"rep": rep, "sessions": sessions, **run_server(cfg, sessions, args.threads)})
    report = {"bench": "agent_chat", "command": args.command, "repeats": args.repeats, "config": dataclasses.asdict(cfg),
              "rows": medians(runs), "runs": runs}
    out = BenchOutput("agent_chat", args.out)
    out.finish(out.write_report("agent_chat_demo", report, markdown(report)))
    return report


def _parse(argv: Sequence[str] | None) -> Any:
    d = ChatTraceConfig()
    p = bench_parser("agent_chat", __doc__)
    p.add_argument("--agents", type=int, default=d.agents)
    p.add_argument("--arrivals-per-s", type=float, default=d.arrivals_per_s)
    p.add_argument("--tool-median-s", type=float, default=d.tool_median_s)
    p.add_argument("--tool-p95-s", type=float, default=d.tool_p95_s)
    p.add_argument("--fillers", type=int, default=d.fillers, help="clients sending churn traffic")
    p.add_argument("--filler-words", type=int, default=d.filler_words, help="words in each filler request")
    p.add_argument("--kv-cache-tokens", type=int, default=d.kv_tokens, help="the server's KV pool")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server's engine")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; each row is their median")
    p.add_argument("--seed", type=int, default=d.seed)
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
