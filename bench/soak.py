"""A soak: `radixserve serve` under a long mixed load with a small KV pool, and a verdict on what it must never do.

For --minutes, --concurrency clients send seeded requests from every API (bench/soak_traffic.py): chat streamed and
not, with shared system prompts and several cache_salt tenants, completions, /generate with token ids, /v1/responses
chains through previous_response_id, tool calls, json_schema output, n > 1, clients that hang up mid-stream,
/abort_request of running requests, about one malformed request in 20, and every --burst-every-s a burst of
--burst-size requests past --max-queued-requests. The KV pool (--kv-cache-tokens) is small, so eviction and
retraction run all along. RSS of the server and engine processes is sampled every 10 s.

Then (bench/soak_checks.py): every request ended in exactly one allowed outcome (no hang past the client deadline,
no 5xx, an aborted request a normal finish, a 4xx for each malformed one), the server idle with the KV identity
(free + evictable + locked + in flight = total, nothing locked or in flight), /health and /health_generate 200,
each process's RSS grown by less than 50 MB since the warm-up, no traceback in the server's log. With
--kill-engine the engine process is SIGKILLed halfway: the server must exit non-zero (as the README promises) and
the requests cut by the kill end within 2 s. With --replicas N the server runs N workers behind sglang-router and
--kill-engine kills worker 0's engine: the supervisor restarts that worker, the kill window lasts until it answers
/health again, and the traffic goes on to the end (each worker's idle state is checked). Writes
soak_MODEL.{json,md}; exits 1 on any violation.

    python -m radixserve.bench.soak --minutes 30                 # the demo model (the long form)
    python -m radixserve.bench.soak --model S --minutes 2 --warmup-s 30   # the short form CI runs
    python -m radixserve.bench.soak --minutes 10 --replicas 2 --kill-engine
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import sys
import time
from typing import Any, Sequence

import httpx

from . import soak_checks
from .output import BenchOutput, bench_parser, parse_args
from .soak_traffic import Outcome, Traffic, burst

KILL_STREAM_END_S = 2.0  # requests the engine's death cuts end within this
WORKER_LINE = re.compile(r"worker (\d+) (?:ready on|is back on) (http://\S+) \(pid (\d+)\)")
ERRORS = ("error-event", "transport", "cut", "500", "502", "503", "504")


def worker_urls(log: str) -> dict[int, str]:
    """The replicas' worker URLs as the supervisor last announced them (a restarted worker has a new port)."""
    return {int(m.group(1)): m.group(2) for m in WORKER_LINE.finditer(log)}


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Soak:
    """One run against a server at `url`; `pids` names the processes whose RSS is sampled."""

    def __init__(self, url: str, args: Any, pids: dict[str, int], engine_pid: int | None,
                 server: Any = None) -> None:
        self.url, self.args, self.pids, self.engine_pid, self.server = url, args, pids, engine_pid, server
        self.outcomes: list[Outcome] = []
        self.samples: dict[str, list[tuple[float, float]]] = {name: [] for name in pids}
        self.kill_at: float | None = None
        self.back_at: float | None = None  # replicas: when the killed worker answered /health again
        self.start = 0.0

    def kill_windows(self) -> list[tuple[float, float]]:
        return [] if self.kill_at is None else [(self.kill_at, self.back_at or float("inf"))]

    async def run(self, model: str) -> None:
        self.start = time.monotonic()
        end = self.start + self.args.minutes * 60
        # An idle pooled connection is dropped after 2 s, before the server's 5 s keep-alive timeout closes it:
        # with httpx's default (5 s, the same as uvicorn's) a request sent on a connection the server is closing
        # fails with a ReadError, a race every HTTP client has with every keep-alive server, not a server fault.
        limits = httpx.Limits(max_connections=self.args.concurrency + self.args.burst_size + 8, keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=self.url, timeout=None, limits=limits) as client:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(self._client(client, model, i, end, stop))
                     for i in range(self.args.concurrency)]
            tasks.append(asyncio.create_task(self._bursts(client, model, end, stop)))
            tasks.append(asyncio.create_task(self._sample(end, stop)))
            if self.args.kill_engine:
                tasks.append(asyncio.create_task(self._kill((self.start + end) / 2, stop)))
            await asyncio.gather(*tasks)

    async def _client(self, client: httpx.AsyncClient, model: str, idx: int, end: float, stop: asyncio.Event) -> None:
        traffic = Traffic(client, model, random.Random(self.args.seed * 1000 + idx), self.args.deadline_s)
        while time.monotonic() < end and not stop.is_set():
            if self.kill_at is not None and not self.args.replicas:
                return  # the server is going away: what was sent is what the verdict reads
            self.outcomes += await traffic.run(traffic.pick())

    async def _bursts(self, client: httpx.AsyncClient, model: str, end: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _sleep_until(min(time.monotonic() + self.args.burst_every_s, end), stop)
            if time.monotonic() >= end or stop.is_set():
                return
            self.outcomes += await burst(client, model, self.args.burst_size, self.args.deadline_s)

    async def _sample(self, end: float, stop: asyncio.Event) -> None:
        while True:
            now = time.monotonic()
            for name, pid in list(self.pids.items()):
                if (rss := rss_mb(pid)) is not None:
                    self.samples.setdefault(name, []).append((now - self.start, rss))
            if now >= end or stop.is_set():
                return
            await _sleep_until(min(now + 10.0, end), stop)

    async def _kill(self, at: float, stop: asyncio.Event) -> None:
        await _sleep_until(at, stop)
        if self.engine_pid is None:
            return
        os.kill(self.engine_pid, signal.SIGKILL)
        self.kill_at = time.monotonic()
        if not self.args.replicas:  # the server exits: the run ends once what was open has ended
            await asyncio.sleep(KILL_STREAM_END_S + 3.0)
            stop.set()
            return
        self.pids = {n: p for n, p in self.pids.items() if not n.startswith("worker0")}  # restarted from scratch
        old = worker_urls(self.server.log())[0]
        end = self.start + self.args.minutes * 60
        while not stop.is_set() and time.monotonic() < end + 60:  # the supervisor restarts worker 0 on a new port;
            # the window ends when it answers (kill_violations names a worker that never came back)
            url = worker_urls(self.server.log()).get(0, old)
            if url != old and await _healthy(url):
                self.back_at = time.monotonic()
                return
            await asyncio.sleep(0.2)


async def _healthy(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.get(url + "/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def _sleep_until(when: float, stop: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(0.0, when - time.monotonic()))
    except TimeoutError:
        pass


def kill_violations(soak: Soak, exit_code: int | None) -> list[str]:
    """Without replicas the server exits non-zero after its engine is killed; with them the worker came back. The
    requests the kill cut (an error, a cut stream, a 5xx) ended within 2 s of it."""
    if soak.kill_at is None:
        return []
    out = []
    if not soak.args.replicas and exit_code in (None, 0):
        out.append(f"the server did not exit non-zero after its engine was killed ({exit_code})")
    if soak.args.replicas and soak.back_at is None:
        out.append("the killed worker never answered /health again")
    late = [o for o in soak.outcomes if o.status in ERRORS
            and o.start < soak.kill_at < o.start + o.latency_s - KILL_STREAM_END_S]
    if late:
        out.append(f"{len(late)} request(s) cut by the kill ended more than {KILL_STREAM_END_S:.0f} s after it")
    return out


def finish_checks(url: str, stats_urls: list[str], log: str | None) -> tuple[list[str], dict[str, Any]]:
    """After the traffic: each engine idle with the KV identity, both health endpoints, the log."""
    found: list[str] = []
    stats: dict[str, Any] = {}
    with httpx.Client(timeout=60) as client:
        for at in stats_urls:
            stats = _wait_idle(client, at)
            found += [f"{at}: {v}" if len(stats_urls) > 1 else v for v in soak_checks.idle_violations(stats)]
        for path in ("/health", "/health_generate"):
            code = client.get(url + path).status_code
            if code != 200:
                found.append(f"{path} answered {code} after the run")
    return found + soak_checks.log_violations(log or ""), stats


def _wait_idle(client: httpx.Client, url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline, stats = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        info = client.get(url + "/get_server_info").json()
        stats = info["stats"]
        if info.get("num_in_flight", 0) == 0 and not stats["num_running"] and not stats["num_waiting"]:
            break
        time.sleep(0.2)
    return stats


def report(soak: Soak, args: Any, violations: list[str], stats: dict[str, Any],
           exit_code: int | None = None) -> tuple[dict[str, Any], str]:
    rows = soak_checks.summary(soak.outcomes)
    warmup_end = args.warmup_s
    rss = {name: {"start_mb": s[0][1] if s else None, "growth_after_warmup_mb": soak_checks.rss_growth(s, warmup_end),
                  "end_mb": s[-1][1] if s else None} for name, s in soak.samples.items()}
    data = {"bench": "soak", "command": args.command, "model": args.model or "demo", "minutes": args.minutes,
            "requests": len(soak.outcomes), "violations": violations, "rows": rows, "rss": rss, "final_stats": stats,
            "killed_engine_at_s": None if soak.kill_at is None else soak.kill_at - soak.start,
            "kill_window_s": None if soak.kill_at is None or soak.back_at is None else soak.back_at - soak.kill_at,
            "server_exit_status": exit_code,
            "violating_requests": [{"kind": o.kind, "status": o.status, "start_s": round(o.start - soak.start, 3),
                                    "latency_s": round(o.latency_s, 3), "detail": o.detail[:300]}
                                   for o in soak_checks.violating(soak.outcomes, soak.kill_windows())[:200]],
            "settings": {k: getattr(args, k) for k in ("concurrency", "kv_cache_tokens", "max_queued_requests",
                                                       "burst_size", "burst_every_s", "deadline_s", "seed",
                                                       "warmup_s")}}
    table = ["| kind | status | requests | latency p50 s | latency max s |", "|---|---|---|---|---|"]
    table += [f"| {r['kind']} | {r['status']} | {r['count']} | {r['p50_s']:.2f} | {r['max_s']:.2f} |" for r in rows]
    lines = [f"# Soak: {data['model']}, {args.minutes:g} min", "", f"`{args.command}`", "",
             f"{len(soak.outcomes)} requests; settings {data['settings']}.", "", *table, "",
             "RSS (MB): " + "; ".join(_rss_text(n, v, warmup_end) for n, v in rss.items()), "",
             "Final engine stats: " + ", ".join(f"{k} {stats.get(k)}" for k in (
                 "total_slots", "free_slots", "evictable_slots", "locked_slots", "in_flight_slots", "num_running",
                 "num_waiting", "num_retractions", "num_evicted_tokens", "num_requests_aborted") if k in stats), "",
             _kill_text(data), "",
             "**Violations**: " + ("none" if not violations else "; ".join(violations)), ""]
    if data["violating_requests"]:
        lines += ["First violating requests (kind, outcome, sent at s into the run, latency s, detail): " + "; ".join(
            f"{v['kind']} {v['status']} at {v['start_s']:.1f} ({v['latency_s']:.2f}) {v['detail'][:80]!r}"
            for v in data["violating_requests"][:12]), ""]
    return data, "\n".join(lines)


def _kill_text(data: dict[str, Any]) -> str:
    if data["killed_engine_at_s"] is None:
        return f"No kill; the server stopped with exit status {data['server_exit_status']}."
    back = ("" if data["kill_window_s"] is None else
            f"; the killed worker answered /health {data['kill_window_s']:.1f} s later")
    return (f"Engine SIGKILLed {data['killed_engine_at_s']:.0f} s into the run{back}; the server's exit status "
            f"{data['server_exit_status']}.")


def _rss_text(name: str, rss: dict[str, Any], warmup_end: float) -> str:
    growth = rss["growth_after_warmup_mb"]
    grown = "not measured" if growth is None else f"{growth:+.0f}"
    return (f"{name} {rss['start_mb'] or 0:.0f} at the start, {rss['end_mb'] or 0:.0f} at the end, "
            f"{grown} after the {warmup_end:g} s warm-up")


def main(argv: Sequence[str] | None = None) -> int:
    from ..frontend.spawn import ServerProcess, stop_process

    args = _parse(argv)
    server = None
    if args.url is None:
        serve = ["--kv-cache-tokens", str(args.kv_cache_tokens), "--max-queued-requests", str(args.max_queued_requests),
                 "--num-threads", str(args.threads), "--max-running-requests", str(args.max_running_requests)]
        if args.replicas:
            serve += ["--replicas", str(args.replicas)]
        if args.model:
            from .harness import bench_model_path

            serve = ["--model", bench_model_path(args.model), *serve]
        server = ServerProcess(serve)
    url = args.url or server.url
    workers = worker_urls(server.log()) if server is not None and args.replicas else {}
    engines = {i: httpx.get(w + "/get_server_info", timeout=60).json().get("engine_pid") for i, w in workers.items()}
    info = httpx.get(url + "/get_server_info", timeout=60).json() if not workers else {}
    engine_pid = engines.get(0) if workers else info.get("engine_pid")
    pids = _pids(server, info, workers, engines)
    soak = Soak(url, args, pids, engine_pid if server is not None else None, server)
    model = info.get("served_model_name") or _served_name(url)
    violations: list[str] = []
    stats: dict[str, Any] = {}
    try:
        asyncio.run(soak.run(model))
        violations += soak_checks.outcome_violations(soak.outcomes, soak.kill_windows())
        if soak.kill_at is None or args.replicas:
            stats_urls = list(worker_urls(server.log()).values()) if workers else [url]
            found, stats = finish_checks(url, stats_urls, server.log() if server is not None else None)
            violations += found + soak_checks.rss_violations(soak.samples, args.warmup_s)
    finally:
        code = stop_process(server.proc, 60) if server is not None else None
    violations += kill_violations(soak, code)
    data, markdown = report(soak, args, violations, stats, code)
    out = BenchOutput("soak", args.out)
    out.write_report(f"soak_{data['model']}", data, markdown)
    if violations and server is not None:  # the evidence for whoever looks into them
        out.write_text(f"soak_{data['model']}.log", server.log())
    out.finish(markdown)
    return 1 if violations else 0


def _pids(server: Any, info: dict[str, Any], workers: dict[int, str], engines: dict[int, Any]) -> dict[str, int]:
    """The processes whose RSS is sampled: the server (or supervisor) and every engine (and worker) it runs."""
    if server is None:
        return {}
    if not workers:
        return {"server": server.proc.pid, "engine": info["engine_pid"]} if info.get("engine_pid") else {}
    pids = {"supervisor": server.proc.pid}
    for m in WORKER_LINE.finditer(server.log()):
        pids[f"worker{m.group(1)}"] = int(m.group(3))
    pids.update({f"worker{i}-engine": pid for i, pid in engines.items() if pid})
    return pids


def _served_name(url: str) -> str:
    models = httpx.get(url + "/v1/models", timeout=60).json().get("data") or [{}]
    return models[0].get("id") or "default"


def _parse(argv: Sequence[str] | None) -> Any:
    p = bench_parser("soak", __doc__)
    p.add_argument("--model", help="bench model (S, M, L), a checkpoint directory or a config.json "
                                   "(default: the built-in demo model)")
    p.add_argument("--url", help="soak a server already running there instead of starting one (no RSS or log checks)")
    p.add_argument("--minutes", type=float, default=3.0, help="how long the traffic runs")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="seconds after which RSS must stop growing (first compiles and caches fill before)")
    p.add_argument("--concurrency", type=int, default=24, help="clients sending at once, besides the bursts")
    p.add_argument("--kv-cache-tokens", type=int, default=1024,
                   help="the server's KV pool: small, so eviction and retraction run")
    p.add_argument("--max-running-requests", type=int, default=16, help="the server's running-request limit")
    p.add_argument("--max-queued-requests", type=int, default=64, help="the server's queue; bursts go past it")
    p.add_argument("--burst-size", type=int, default=160, help="requests in each burst")
    p.add_argument("--burst-every-s", type=float, default=45.0, help="seconds between bursts")
    p.add_argument("--deadline-s", type=float, default=120.0, help="a request not answered by then is a hang")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server's engine")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic")
    p.add_argument("--replicas", type=int, default=0,
                   help="run the server with this many workers behind sglang-router (0: one server)")
    p.add_argument("--kill-engine", action="store_true",
                   help="SIGKILL the engine process halfway (with --replicas, worker 0's); without replicas the run "
                        "ends when the server exits")
    return parse_args(p, argv)


if __name__ == "__main__":
    sys.exit(main())
