"""HTTP serving vs the offline Engine: what the server costs on one shared-prefix workload, at several
concurrency levels (~2 min on model S, ~5 on M).

    python -m radixserve.bench.http_bench --model S            # http_bench_S.{json,md,png}
    python -m radixserve.bench.http_bench --model M            # http_bench_M.{json,md,png}
    python -m radixserve.bench.http_bench --model tiny --concurrency 8 --runs 1   # seconds

Per concurrency level c (default 1, 8, 32, 64), the same requests run in a closed loop (at most c
in flight; the next request goes when one finishes) on two sides, alternating:

  http     one `radixserve serve` subprocess, --num-threads T; streaming POST /v1/completions from
           c client connections in this process (bench/http_client.py: a small asyncio HTTP/1.1 client, stdlib only);
  offline  Engine(num_threads=T) in this process, driven through add_request / step.

Each run starts from an emptied prefix cache (POST /flush_cache; Engine.flush_cache()) after
--settle-s idle seconds (an engine's OpenMP threads keep spinning a while after its last call);
the order alternates every repetition (http, offline; offline, http; ...); the report gives the
median of --runs runs per side and level. The client shares the machine's cores with the server
(it is part of what serving costs on one machine); the offline side has no client.

Requests go as token ids to /v1/completions (`prompt` = a list of ids, `return_token_ids`, usage
in the last chunk): the same endpoint that vLLM's serving benchmark drives (bench/peer_serve.py), and
both sides get the very same token ids, so the ratio is transport, process boundary, detokenization
and the client -- not tokenization differences. Workload: gsp (bench/workloads.py SharedSystemPrompt),
sized per model (PRESETS); all requests of a run are known up front.

Reported per side and level: req/s, total tok/s (all prompt tokens, cached included, + output),
output tok/s, TTFT and TPOT p50/p99 measured at the client (TPOT = (last token - first token) /
(tokens - 1), per request), hit rate; the ratio HTTP / offline of the median req/s, and the
per-repetition paired ratios. Targets (shown, not asserted): HTTP/offline >= 0.9 on model M, >= 0.8 on S.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from .http_client import HTTPConnection
from .output import BenchOutput, bench_parser, parse_args, percentile, progress
from .report_http import SIDES, build_report, write_report
from .workloads import SharedSystemPrompt, WorkRequest

logger = logging.getLogger(__name__)

# gsp per model: 64 requests (c=64 has work for every slot). S: the full-size gsp; M: shorter
# prompts and outputs so that c=1 (64 requests one after the other) stays within minutes.
PRESETS: dict[str, dict[str, int]] = {
    "S": dict(num_groups=8, per_group=8, system_len=1024, question_len=64, output_len=32),
    "M": dict(num_groups=8, per_group=8, system_len=512, question_len=32, output_len=16),
    "tiny": dict(num_groups=2, per_group=4, system_len=32, question_len=8, output_len=4),
}


@dataclass
class Timing:
    """One request, seen from its client: seconds from submission to its first and last token."""

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

    def token(self, now: float, count: int) -> None:
        if count:
            self.output_tokens += count
            self.ttft_s = now if self.ttft_s is None else self.ttft_s
            self.last_s = now


def summarize_run(timings: Sequence[Timing], wall_s: float) -> dict[str, Any]:
    prompt = sum(t.prompt_tokens for t in timings)
    output = sum(t.output_tokens for t in timings)
    cached = sum(t.cached_tokens for t in timings)
    ttft = [t.ttft_s for t in timings if t.ttft_s is not None]
    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    return {
        "num_requests": len(timings), "wall_s": wall_s, "req_per_s": len(timings) / wall_s,
        "tok_per_s": (prompt + output) / wall_s, "output_tok_per_s": output / wall_s,
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
    }


# -- HTTP side ----------------------------------------------------------------------------------


def completion_body(req: WorkRequest, model: str | None = None) -> bytes:
    body: dict[str, Any] = {"prompt": list(req.prompt_ids), "max_tokens": req.max_new_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True}
    if model is not None:
        body["model"] = model
    return orjson.dumps(body)


async def _http_request(conn: HTTPConnection, req: WorkRequest) -> Timing:
    timing = Timing(prompt_tokens=len(req.prompt_ids))
    body = completion_body(req)
    start = time.perf_counter()
    async for line in conn.post_lines("/v1/completions", body):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        now = time.perf_counter() - start
        chunk = orjson.loads(line[6:])
        usage = chunk.get("usage")
        if usage:
            timing.prompt_tokens = usage.get("prompt_tokens", timing.prompt_tokens)
            timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        for choice in chunk.get("choices") or ():
            timing.token(now, len(choice.get("token_ids") or ()))
    if timing.output_tokens != req.max_new_tokens:
        raise RuntimeError(f"{req.key}: {timing.output_tokens} tokens streamed, {req.max_new_tokens} asked for")
    return timing


async def run_http(url: str, requests: Sequence[WorkRequest], concurrency: int) -> tuple[list[Timing], float]:
    """The closed loop over HTTP: `concurrency` connections, each sending the next queued request
    as soon as its previous one has finished."""
    parts = urlsplit(url)
    queue: deque[WorkRequest] = deque(requests)
    timings: list[Timing] = []
    conns = [HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80) for _ in range(concurrency)]

    async def worker(conn: HTTPConnection) -> None:
        while queue:
            timings.append(await _http_request(conn, queue.popleft()))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
        wall_s = time.perf_counter() - start
    finally:
        for conn in conns:
            await conn.close()
    return timings, wall_s


# -- offline side -------------------------------------------------------------------------------


def run_offline(engine: Any, requests: Sequence[WorkRequest], concurrency: int) -> tuple[list[Timing], float]:
    """The same closed loop in this thread: add_request while fewer than `concurrency` are in
    flight, then one step; a request's times count from its add_request."""
    from ..scheduler import SamplingParams

    queue: deque[WorkRequest] = deque(requests)
    active: dict[str, tuple[float, Timing]] = {}
    timings: list[Timing] = []
    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            req = queue.popleft()
            params = SamplingParams(max_new_tokens=req.max_new_tokens, temperature=0.0, ignore_eos=True)
            rid = engine.add_request(list(req.prompt_ids), params)
            active[rid] = (time.perf_counter(), Timing(prompt_tokens=len(req.prompt_ids)))
        for delta in engine.step():
            submitted, timing = active[delta.rid]
            timing.token(time.perf_counter() - submitted, len(delta.token_ids))
            if delta.finished:
                if delta.result is not None:
                    if delta.result.finish_reason == "abort":
                        raise RuntimeError(f"the engine aborted a request: {delta.result.error}")
                    timing.cached_tokens = delta.result.cached_tokens
                timings.append(timing)
                del active[delta.rid]
    return timings, time.perf_counter() - start


# -- driver -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch
    from .harness import bench_model_path, warm_up
    from ..frontend.spawn import ServerProcess
    from ..scheduler import Engine

    started = time.perf_counter()
    workload = SharedSystemPrompt(**args.workload, seed=args.seed)
    requests = workload.make_round(0, {}).requests
    model_path = args.model_path or bench_model_path(args.model)
    kv = args.kv_cache_tokens or sum(len(r.prompt_ids) + r.max_new_tokens for r in requests) + 256
    engine_flags = {"kv_cache_tokens": kv, "max_running_requests": max(args.concurrency)}
    torch.set_num_threads(args.threads)
    server_args = ["--model", model_path, "--num-threads", str(args.threads),
                   *[x for k, v in engine_flags.items() for x in ("--" + k.replace("_", "-"), str(v))]]
    server = ServerProcess(server_args, env={"OMP_NUM_THREADS": str(args.threads)})
    engine = None
    runs: list[dict[str, Any]] = []
    try:
        engine = Engine(model_path, num_threads=args.threads, **engine_flags)
        warm_up(engine)
        asyncio.run(run_http(server.url, [WorkRequest("warm", list(range(100, 164)), 4)] * 2, 2))
        with progress(len(args.concurrency) * args.runs * len(SIDES), "http bench") as bar:
            for concurrency in args.concurrency:
                for rep in range(args.runs):
                    for side in SIDES if rep % 2 == 0 else tuple(reversed(SIDES)):
                        runs.append(_one_run(side, server.url, engine, requests, concurrency, rep, args.settle_s))
                        bar.update()
    finally:
        if engine is not None:
            engine.shutdown()
        server.stop()
    config = _config(args, workload, model_path, engine_flags)
    config["elapsed_s"] = time.perf_counter() - started
    report = build_report(runs, config)
    out = BenchOutput("http_bench", args.out)
    out.finish(write_report(report, out))
    return report


def _one_run(side: str, url: str, engine: Any, requests: Sequence[WorkRequest], concurrency: int, rep: int,
             settle_s: float) -> dict[str, Any]:
    """One side's run at one level, from an emptied prefix cache after settle_s idle seconds."""
    if side == "http":
        _flush_server(url)
    elif not engine.flush_cache():
        raise RuntimeError("Engine.flush_cache refused: requests still in flight")
    time.sleep(settle_s)
    if side == "http":
        timings, wall_s = asyncio.run(run_http(url, requests, concurrency))
    else:
        timings, wall_s = run_offline(engine, requests, concurrency)
    run = {"side": side, "concurrency": concurrency, "rep": rep, **summarize_run(timings, wall_s)}
    logger.info("c=%d rep %d %s: %.2f req/s", concurrency, rep, side, run["req_per_s"])
    return run


def _flush_server(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.post(url + "/flush_cache", timeout=60)
        if response.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server refused to flush its cache: {response.status_code} {response.text}")
        time.sleep(0.1)


def _config(args: argparse.Namespace, workload: SharedSystemPrompt, model_path: str, engine_flags: dict) -> dict:
    import torch

    return {"command": args.command, "model": args.model,
            "model_path": model_path, "workload": workload.describe(), "concurrency": args.concurrency,
            "runs": args.runs, "threads": args.threads, "settle_s": args.settle_s, "engine": engine_flags,
            "endpoint": "/v1/completions (token ids, streamed)", "client": "stdlib asyncio HTTP/1.1, in-process",
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("http_bench", __doc__)
    p.add_argument("--model", default="S", choices=tuple(PRESETS),
                   help="bench model (random weights, built once into the cache; tiny runs in seconds); it also "
                        "picks the workload's preset")
    p.add_argument("--model-path", default=None, help="a checkpoint directory to serve instead of the bench model")
    add_gsp_flags(p, PRESETS)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated concurrency levels (requests in flight)")
    p.add_argument("--runs", type=int, default=3, help="runs per side and level; the report gives their median")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server and of the offline engine")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV pool of both engines in tokens (default: every request's prompt + output, so nothing "
                        "is evicted)")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="idle seconds before each run, so the previous run's spinning threads have stopped")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = parse_args(p, argv)
    args.workload = {k: getattr(args, k) or v for k, v in PRESETS[args.model].items()}
    if args.runs < 1 or min(args.concurrency) < 1:
        p.error("--runs and every concurrency level must be >= 1")
    return args


_GSP_HELP = {"num_groups": "groups of requests that share one system prompt", "per_group": "requests per group",
             "system_len": "tokens of each system prompt", "question_len": "tokens after the system prompt",
             "output_len": "tokens generated per request", "system_words": "words of each system prompt",
             "question_words": "words after the system prompt"}


def add_gsp_flags(p: argparse.ArgumentParser, presets: dict[str, dict[str, int]]) -> None:
    """--groups, --per-group, ...: one flag per field of the shared-system-prompt workload's presets."""
    first = next(iter(presets.values()))
    for key in first:
        shown = "; ".join(f"{model}: {preset[key]}" for model, preset in presets.items())
        p.add_argument("--" + key.replace("_", "-").replace("num-groups", "groups"), dest=key, type=int,
                       help=f"{_GSP_HELP[key]} (default: the model's preset, {shown})")


if __name__ == "__main__":
    main()
