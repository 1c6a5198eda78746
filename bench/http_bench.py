"""HTTP serving benchmark (issue 3, item 6): the server vs the offline Engine on one shared-prefix workload.

For each concurrency level, the same requests run twice, in the same process run:
  http     closed-loop clients (at most `concurrency` requests in flight) streaming /v1/completions
           from a `radixserve serve` subprocess;
  offline  the same closed loop driven in-process through Engine.add_request / Engine.step.
Both engines have the same settings; the cache is flushed before each run. Reported per run:
requests/s, total tokens/s (prompt tokens, cached included, plus output), TTFT and TPOT p50/p99,
hit rate; and HTTP/offline throughput ratios.

    python -m radixserve.bench.http_bench                       # reduced size (minutes on a 2-core CPU)
    python -m radixserve.bench.http_bench --groups 8 --per-group 8 --system-len 1024 --question-len 64 \\
        --output-len 32 --runs 3                                # issue 4's full gsp workload
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from radixserve.bench.harness import bench_model_path
from radixserve.bench.workloads import SharedSystemPrompt, WorkRequest

logger = logging.getLogger(__name__)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass
class Timing:
    """One request: seconds from submission to its first and last token."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    last_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.last_s is None or self.output_tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class RunStats:
    wall_s: float
    timings: list[Timing] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        n = len(self.timings)
        prompt = sum(t.prompt_tokens for t in self.timings)
        output = sum(t.output_tokens for t in self.timings)
        ttft = [t.ttft_s for t in self.timings if t.ttft_s is not None]
        tpot = [t.tpot_s for t in self.timings if t.tpot_s is not None]
        return {
            "num_requests": n, "wall_s": self.wall_s, "req_per_s": n / self.wall_s,
            "total_tok_per_s": (prompt + output) / self.wall_s, "output_tok_per_s": output / self.wall_s,
            "prompt_tokens": prompt, "output_tokens": output,
            "hit_rate": sum(t.cached_tokens for t in self.timings) / max(prompt, 1),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        }


# -- HTTP -------------------------------------------------------------------------------------


async def run_http(url: str, requests: list[WorkRequest], concurrency: int) -> RunStats:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    queue: deque[WorkRequest] = deque(requests)
    timings: list[Timing] = []
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                timings.append(await _http_request(client, queue.popleft()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return RunStats(wall, timings)


async def _http_request(client: httpx.AsyncClient, req: WorkRequest) -> Timing:
    body = {"prompt": req.prompt_ids, "max_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    timing = Timing(prompt_tokens=len(req.prompt_ids))
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            now = time.perf_counter() - start
            if chunk.get("usage"):
                timing.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk["choices"]:
                num = len(choice.get("token_ids") or [])
                if num:
                    timing.output_tokens += num
                    timing.ttft_s = now if timing.ttft_s is None else timing.ttft_s
                    timing.last_s = now
    return timing


# -- offline ------------------------------------------------------------------------------------


def run_offline(engine: Any, requests: list[WorkRequest], concurrency: int) -> RunStats:
    """The same closed loop as the HTTP clients, through add_request/step in this thread."""
    from radixserve.scheduler import SamplingParams

    queue: deque[WorkRequest] = deque(requests)
    active: dict[str, tuple[float, Timing]] = {}
    timings: list[Timing] = []
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            req = queue.popleft()
            params = SamplingParams(max_new_tokens=req.max_new_tokens, temperature=0.0, ignore_eos=True)
            rid = engine.add_request(req.prompt_ids, params)
            active[rid] = (time.perf_counter(), Timing(prompt_tokens=len(req.prompt_ids)))
        for delta in engine.step():
            submitted, timing = active[delta.rid]
            now = time.perf_counter() - submitted
            if delta.token_ids:
                timing.output_tokens += len(delta.token_ids)
                timing.ttft_s = now if timing.ttft_s is None else timing.ttft_s
                timing.last_s = now
            if delta.finished:
                timing.cached_tokens = delta.result.cached_tokens
                timings.append(timing)
                del active[delta.rid]
    return RunStats(time.perf_counter() - start, timings)


# -- driver -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    workload = SharedSystemPrompt(args.groups, args.per_group, args.system_len, args.question_len, args.output_len,
                                  seed=args.seed)
    requests = workload.make_round(0, {}).requests
    model_path = args.model_path or bench_model_path(args.model)
    engine_flags = {"kv_cache_tokens": args.kv_cache_tokens, "max_running_requests": max(args.concurrency)}
    report: dict[str, Any] = {"config": _config(args, workload, model_path, engine_flags), "levels": []}

    import torch

    from radixserve.frontend.spawn import ServerProcess
    from radixserve.scheduler import Engine

    # Both engines get the same intra-op threads (on a busy 2-core machine, 2 spinning OpenMP threads
    # made forwards 10-15x slower than 1).
    torch.set_num_threads(args.threads)
    server = ServerProcess(["--model", model_path, "--num-threads", str(args.threads), *_flags(engine_flags)],
                           env={"OMP_NUM_THREADS": str(args.threads)})
    engine = Engine(model_path, num_threads=args.threads, **engine_flags)
    try:
        _warm_up(server.url, engine, requests[0])
        for concurrency in args.concurrency:
            level = _run_level(server, engine, requests, concurrency, args.runs)
            report["levels"].append(level)
            logger.info("concurrency %d: http %.2f req/s, offline %.2f req/s, ratio %.3f", concurrency,
                        level["http"]["req_per_s"], level["offline"]["req_per_s"], level["throughput_ratio"])
    finally:
        engine.shutdown()
        server.stop()
    _write(report, args.out)
    return 0


def _run_level(server: Any, engine: Any, requests: list[WorkRequest], concurrency: int, runs: int) -> dict:
    http_runs, offline_runs = [], []
    for _ in range(runs):  # alternate so that machine noise hits both sides alike
        engine.flush_cache()
        offline_runs.append(run_offline(engine, requests, concurrency).summary())
        _flush_server(server.url)
        http_runs.append(asyncio.run(run_http(server.url, requests, concurrency)).summary())
    http, offline = _median(http_runs), _median(offline_runs)
    return {"concurrency": concurrency, "http": http, "offline": offline, "runs": runs,
            "throughput_ratio": http["total_tok_per_s"] / offline["total_tok_per_s"],
            "ttft_p50_ratio": _ratio(http["ttft_p50_s"], offline["ttft_p50_s"]),
            "tpot_p50_ratio": _ratio(http["tpot_p50_s"], offline["tpot_p50_s"])}


def _warm_up(url: str, engine: Any, req: WorkRequest) -> None:
    short = WorkRequest("warm", req.prompt_ids[:64], 4)
    run_offline(engine, [short], 1)
    asyncio.run(run_http(url, [short], 1))


def _flush_server(url: str) -> None:
    for _ in range(100):
        if httpx.post(url + "/flush_cache", timeout=60).status_code == 200:
            return
        time.sleep(0.1)
    raise RuntimeError("the server refused to flush its cache")


def _median(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if s[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def _pct(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _flags(engine_flags: dict[str, Any]) -> list[str]:
    return [x for k, v in engine_flags.items() if v is not None for x in ("--" + k.replace("_", "-"), str(v))]


def _config(args: argparse.Namespace, workload: SharedSystemPrompt, model_path: str, engine_flags: dict) -> dict:
    import torch

    return {"model": args.model, "model_path": model_path, "workload": workload.describe(),
            "concurrency": args.concurrency, "runs": args.runs, "engine": engine_flags, "torch_threads": args.threads,
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}}


def _write(report: dict[str, Any], out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(_markdown(report))
    logger.info("wrote %s.json and %s.md", out, out)


def _markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    w = cfg["workload"]
    lines = [
        "# HTTP serving benchmark (`python -m radixserve.bench.http_bench`)", "",
        f"Model {cfg['model']} (`{os.path.basename(cfg['model_path'])}`), workload gsp: {w['num_groups']} groups x "
        f"{w['per_group']} prompts, system {w['system_len']} + question {w['question_len']} tokens, "
        f"{w['output_len']} output tokens (greedy, ignore_eos). Engine {cfg['engine']}, "
        f"{cfg['torch_threads']} torch thread(s); median of {cfg['runs']} "
        f"run(s) per level; cache flushed before each run; machine {cfg['machine']}.", "",
        "Closed loop: at most `c` requests in flight. `http` = streaming /v1/completions from a server subprocess; "
        "`offline` = the same loop through Engine.add_request/step in-process. Ratio = HTTP / offline total tokens/s.",
        "",
        "| c | http req/s | offline req/s | ratio | http TTFT p50/p99 (s) | offline TTFT p50/p99 (s) "
        "| http TPOT p50/p99 (ms) | offline TPOT p50/p99 (ms) | hit rate http / offline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for level in report["levels"]:
        h, o = level["http"], level["offline"]
        lines.append(
            f"| {level['concurrency']} | {h['req_per_s']:.2f} | {o['req_per_s']:.2f} | {level['throughput_ratio']:.3f} "
            f"| {_s(h['ttft_p50_s'])} / {_s(h['ttft_p99_s'])} | {_s(o['ttft_p50_s'])} / {_s(o['ttft_p99_s'])} "
            f"| {_ms(h['tpot_p50_s'])} / {_ms(h['tpot_p99_s'])} | {_ms(o['tpot_p50_s'])} / {_ms(o['tpot_p99_s'])} "
            f"| {h['hit_rate']:.3f} / {o['hit_rate']:.3f} |")
    lines += ["", "Absolute times on a shared machine are noise; compare the ratios within one run.", ""]
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="M", choices=("S", "M", "tiny"), help="bench model (ARCHITECTURE §8)")
    p.add_argument("--model-path", default=None, help="use this checkpoint instead of a bench model")
    p.add_argument("--groups", type=int, default=4, help="shared system prompts")
    p.add_argument("--per-group", type=int, default=16, help="prompts per system prompt")
    p.add_argument("--system-len", type=int, default=256, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=32, help="question tokens")
    p.add_argument("--output-len", type=int, default=8, help="output tokens per request")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated concurrency levels")
    p.add_argument("--runs", type=int, default=1, help="runs per level (the median is reported)")
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV pool of both engines")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of both engines")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "http_bench"), help="output path without extension")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
