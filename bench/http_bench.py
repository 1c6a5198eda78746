"""HTTP serving vs the offline Engine: what the server costs on one shared-prefix workload (ARCHITECTURE §8).

    python -m radixserve.bench.http_bench --model S            # bench/results/http_bench_S.{json,md,png}
    python -m radixserve.bench.http_bench --model M            # bench/results/http_bench_M.{json,md,png}
    python -m radixserve.bench.http_bench --model tiny --concurrency 8 --runs 1 --out /tmp/hb   # seconds

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
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from radixserve.bench.http_client import HTTPConnection
from radixserve.bench.workloads import SharedSystemPrompt, WorkRequest

logger = logging.getLogger(__name__)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SIDES = ("http", "offline")
# gsp per model: 64 requests (c=64 has work for every slot). S: issue 4's full gsp; M: shorter
# prompts and outputs so that c=1 (64 requests one after the other) stays within minutes.
PRESETS: dict[str, dict[str, int]] = {
    "S": dict(num_groups=8, per_group=8, system_len=1024, question_len=64, output_len=32),
    "M": dict(num_groups=8, per_group=8, system_len=512, question_len=32, output_len=16),
    "tiny": dict(num_groups=2, per_group=4, system_len=32, question_len=8, output_len=4),
}
TARGETS = {"S": 0.8, "M": 0.9}  # HTTP / offline req/s, to show (not asserted)
# The numbers every run summary has (the aggregation takes their medians).
SUMMARY_KEYS = ("num_requests", "wall_s", "req_per_s", "tok_per_s", "output_tok_per_s", "prompt_tokens",
                "cached_tokens", "output_tokens", "hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


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


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default, as vLLM's bench reports)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


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
    from radixserve.scheduler import SamplingParams

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


# -- aggregation and report ---------------------------------------------------------------------


def aggregate(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run records ({"side", "concurrency", "rep", **summarize_run}) -> one row per level: the
    median of each number per side, min/max req/s, and HTTP / offline ratios."""
    levels = []
    for c in sorted({r["concurrency"] for r in runs}):
        level: dict[str, Any] = {"concurrency": c}
        for side in SIDES:
            mine = sorted((r for r in runs if r["concurrency"] == c and r["side"] == side), key=lambda r: r["rep"])
            level[side] = _median_summary(mine) if mine else None
        http, offline = level["http"], level["offline"]
        level["ratio"] = http["req_per_s"] / offline["req_per_s"] if http and offline else None
        level["ratio_tok"] = http["tok_per_s"] / offline["tok_per_s"] if http and offline else None
        if http and offline:
            pairs = dict(zip(offline["reps"], offline["req_per_s_runs"]))
            level["paired_ratios"] = [h / pairs[rep] for rep, h in zip(http["reps"], http["req_per_s_runs"])
                                      if rep in pairs]
        else:
            level["paired_ratios"] = []
        level["tpot_p50_ratio"] = _ratio(http and http["tpot_p50_s"], offline and offline["tpot_p50_s"])
        level["ttft_p50_ratio"] = _ratio(http and http["ttft_p50_s"], offline and offline["ttft_p50_s"])
        levels.append(level)
    return levels


def _median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"num_runs": len(runs), "reps": [r["rep"] for r in runs]}
    for key in SUMMARY_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["req_per_s_runs"] = [r["req_per_s"] for r in runs]
    out["req_per_s_min"] = min(out["req_per_s_runs"])
    out["req_per_s_max"] = max(out["req_per_s_runs"])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_report(runs: Sequence[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    levels = aggregate(runs)
    target = TARGETS.get(config.get("model", ""))
    return {"bench": "http_bench", "config": config, "target_ratio": target,
            "target_met": None if target is None else {str(lv["concurrency"]): lv["ratio"] is not None
                                                       and lv["ratio"] >= target for lv in levels},
            "levels": levels, "records": list(runs)}


_HEAD = ("| c | HTTP req/s (min–max) | offline req/s (min–max) | HTTP tok/s | offline tok/s | **HTTP / offline** "
         "| paired ratios | HTTP TTFT p50 / p99 (ms) | offline TTFT p50 / p99 (ms) | HTTP TPOT p50 / p99 (ms) "
         "| offline TPOT p50 / p99 (ms) | hit rate HTTP / offline |")


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    w = cfg["workload"]
    target = report.get("target_ratio")
    lines = [
        f"# HTTP serving vs the offline Engine, model {cfg['model']} (`python -m radixserve.bench.http_bench`)", "",
        (f"Command: `{cfg.get('command', '').strip()}` ({cfg.get('elapsed_s', 0) / 60:.1f} min). "
         f"Machine {cfg.get('machine')}."), "",
        (f"Model {cfg['model']} (`{os.path.basename(cfg['model_path'])}`); workload gsp: {w['num_groups']} groups x "
         f"{w['per_group']} prompts = {w['num_groups'] * w['per_group']} requests per run, system {w['system_len']} "
         f"+ question {w['question_len']} tokens, {w['output_len']} output tokens (greedy, ignore_eos). "
         f"Both sides: {cfg['threads']} torch thread(s) (`radixserve serve --num-threads {cfg['threads']}` / "
         f"`Engine(num_threads={cfg['threads']})`), engine settings {cfg['engine']}. "
         f"Closed loop, at most c requests in flight. HTTP = streaming POST /v1/completions with token ids "
         f"from c keep-alive connections of a stdlib asyncio client in the bench process, which shares the "
         f"{cfg.get('machine', {}).get('cpus')} cores with the server; offline = the same loop through "
         f"Engine.add_request/step in the bench process (no client). Every run starts from an emptied prefix "
         f"cache after {cfg.get('settle_s', 0):g} s idle; the sides alternate (http first in even repetitions); "
         f"median of {cfg['runs']} run(s) per side and level. TTFT/TPOT are measured at the client, per "
         "request (TPOT = (last - first token) / (tokens - 1)); p50/p99 by linear interpolation. "
         "tok/s = all prompt tokens (cached included) + output tokens. HTTP / offline = ratio of the median "
         "req/s; paired ratios = repetition by repetition."), "",
        _HEAD, "|" + "---|" * 12,
    ]
    for lv in report["levels"]:
        h, o = lv["http"], lv["offline"]
        if not h or not o:
            continue
        paired = ", ".join(f"{x:.2f}" for x in lv["paired_ratios"]) or "-"
        lines.append(
            f"| {lv['concurrency']} | {h['req_per_s']:.2f} ({h['req_per_s_min']:.2f}–{h['req_per_s_max']:.2f}) "
            f"| {o['req_per_s']:.2f} ({o['req_per_s_min']:.2f}–{o['req_per_s_max']:.2f}) | {h['tok_per_s']:.0f} "
            f"| {o['tok_per_s']:.0f} | **{lv['ratio']:.3f}** | {paired} "
            f"| {_ms(h['ttft_p50_s'])} / {_ms(h['ttft_p99_s'])} | {_ms(o['ttft_p50_s'])} / {_ms(o['ttft_p99_s'])} "
            f"| {_ms(h['tpot_p50_s'])} / {_ms(h['tpot_p99_s'])} | {_ms(o['tpot_p50_s'])} / {_ms(o['tpot_p99_s'])} "
            f"| {_rate(h['hit_rate'])} / {_rate(o['hit_rate'])} |")
    lines.append("")
    if target is not None:
        met = report["target_met"]
        lines.append(f"Target (shown, not asserted): HTTP / offline >= {target} on model {cfg['model']}: "
                     + ", ".join(f"c={c} {'met' if ok else 'not met'}" for c, ok in met.items()) + ".")
        lines.append("")
    lines += ["Absolute times on a shared machine are noise; compare the ratios within one invocation.", "",
              f"![HTTP / offline]({os.path.basename(cfg.get('out', 'http_bench'))}.png)", ""]
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(report: dict[str, Any], path: str) -> None:
    """Top: HTTP / offline req/s per level (median; dots: paired repetitions; dashed: the target).
    Bottom: TPOT p50 per side and level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in report["levels"] if lv["http"] and lv["offline"]]
    xs = list(range(len(levels)))
    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(max(6.0, 1.5 * len(levels)), 6.0))
    ax_r.bar(xs, [lv["ratio"] for lv in levels], 0.6, color="tab:blue", label="median")
    for x, lv in zip(xs, levels):
        ax_r.plot([x] * len(lv["paired_ratios"]), lv["paired_ratios"], "k.", markersize=5)
    ax_r.axhline(1.0, color="black", linewidth=0.8)
    if report.get("target_ratio"):
        ax_r.axhline(report["target_ratio"], color="tab:red", linestyle="--", linewidth=1,
                     label=f"target {report['target_ratio']}")
    ax_r.set_ylabel("HTTP / offline req/s")
    ax_r.legend(fontsize=8)
    width = 0.38
    for num, side in enumerate(SIDES):
        vals = [(lv[side]["tpot_p50_s"] or 0.0) * 1000 for lv in levels]
        ax_t.bar([x + (num - 0.5) * width for x in xs], vals, width, label=side)
    ax_t.set_ylabel("TPOT p50 (ms)")
    ax_t.legend(fontsize=8)
    for ax in (ax_r, ax_t):
        ax.set_xticks(xs)
        ax.set_xticklabels([f"c={lv['concurrency']}" for lv in levels])
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"model {report['config']['model']}: HTTP server vs offline Engine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], out: str) -> None:
    """out: path without extension; writes out.json, out.md and out.png."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    with open(out + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(report))
    plot(report, out + ".png")
    logger.info("wrote %s.{json,md,png}", out)


# -- driver -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch
    from radixserve.bench.harness import bench_model_path, warm_up
    from radixserve.frontend.spawn import ServerProcess
    from radixserve.scheduler import Engine

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
        for concurrency in args.concurrency:
            for rep in range(args.runs):
                for side in SIDES if rep % 2 == 0 else tuple(reversed(SIDES)):
                    if side == "http":
                        _flush_server(server.url)
                    elif not engine.flush_cache():
                        raise RuntimeError("Engine.flush_cache refused: requests still in flight")
                    time.sleep(args.settle_s)
                    if side == "http":
                        timings, wall_s = asyncio.run(run_http(server.url, requests, concurrency))
                    else:
                        timings, wall_s = run_offline(engine, requests, concurrency)
                    runs.append({"side": side, "concurrency": concurrency, "rep": rep,
                                 **summarize_run(timings, wall_s)})
                    logger.info("c=%d rep %d %s: %.2f req/s", concurrency, rep, side, runs[-1]["req_per_s"])
    finally:
        if engine is not None:
            engine.shutdown()
        server.stop()
    config = _config(args, workload, model_path, engine_flags)
    config["elapsed_s"] = time.perf_counter() - started
    report = build_report(runs, config)
    write_report(report, args.out)
    for lv in report["levels"]:
        logger.info("c=%d: HTTP / offline = %.3f", lv["concurrency"], lv["ratio"])
    return report


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

    return {"command": "python -m radixserve.bench.http_bench " + " ".join(args.argv), "model": args.model,
            "model_path": model_path, "workload": workload.describe(), "concurrency": args.concurrency,
            "runs": args.runs, "threads": args.threads, "settle_s": args.settle_s, "engine": engine_flags,
            "endpoint": "/v1/completions (token ids, streamed)", "client": "stdlib asyncio HTTP/1.1, in-process",
            "out": args.out,
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="S", choices=tuple(PRESETS), help="bench model (ARCHITECTURE §8)")
    p.add_argument("--model-path", default=None, help="use this checkpoint instead of the bench model")
    for key in PRESETS["S"]:
        p.add_argument("--" + key.replace("_", "-").replace("num-groups", "groups"), dest=key, type=int,
                       help=f"gsp {key.replace('_', ' ')} (default: the model's preset)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated concurrency levels")
    p.add_argument("--runs", type=int, default=3, help="runs per side and level (the median is reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of both engines")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV pool of both engines (default: every request's prompt + output, no eviction)")
    p.add_argument("--settle-s", type=float, default=1.0, help="idle seconds before each run")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--out", default=None, help="output path without extension (default results/http_bench_MODEL)")
    args = p.parse_args(argv)
    args.workload = {k: getattr(args, k) or v for k, v in PRESETS[args.model].items()}
    args.out = args.out or os.path.join(RESULTS_DIR, f"http_bench_{args.model}")
    if args.runs < 1 or min(args.concurrency) < 1:
        p.error("--runs and every concurrency level must be >= 1")
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


if __name__ == "__main__":
    main()
