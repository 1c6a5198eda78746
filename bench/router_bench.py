"""Cache-aware routing across replicas: `serve --replicas N` behind sglang-router, cache_aware vs
round_robin vs one worker, on shared-system-prompt chat requests as text (~2 min on model S).

    python -m radixserve.bench.router_bench --model S --replicas 4     # router_bench_S.{json,md}
    python -m radixserve.bench.router_bench --model tiny --replicas 2 --groups 4 --per-group 4

Workload: gsp (G groups x P chat requests; a group's requests share one system prompt, each has its
own question), in a seeded shuffled order, as *text*: sglang-router's cache_aware policy matches
the prompt text against its approximate radix tree per worker, so token-id prompts would give it
nothing to route on. Sides, each from an emptied prefix cache:

  single       one `radixserve serve` with all the cores' threads (the cache an unsplit engine gets);
  cache_aware  `serve --replicas N` (N workers, cores // N threads each) behind the router;
  round_robin  the same N workers behind a second router with --policy round_robin.

Each side streams POST /v1/chat/completions from --concurrency client connections (closed loop).
Reported: aggregate prefix-cache hit rate and prompt tokens computed (summed over the workers'
/get_server_info counters), req/s, TTFT p50/p99 at the client. On a machine with few cores the
throughput is bound by the cores (N workers share them); the hit rate is the headline.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .http_bench import add_gsp_flags
from .output import BenchOutput, bench_parser, parse_args, percentile, progress

logger = logging.getLogger(__name__)

SIDES = ("single", "cache_aware", "round_robin")
# Words per system prompt / question and output tokens per bench model (4096-token context; with the
# demo tokenizer a word of these syllables is about two tokens).
PRESETS: dict[str, dict[str, int]] = {
    "S": dict(num_groups=16, per_group=8, system_words=300, question_words=12, output_len=32),
    "tiny": dict(num_groups=8, per_group=4, system_words=40, question_words=3, output_len=2),
}
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "el", "or", "ut", "ix")


@dataclass(frozen=True)
class TextRequest:
    group: int
    system: str
    question: str
    max_tokens: int

    def body(self, model: str, stream: bool = True) -> dict[str, Any]:
        body = {"model": model, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "system", "content": self.system},
                             {"role": "user", "content": self.question}]}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def text_gsp(num_groups: int, per_group: int, system_words: int, question_words: int, output_len: int,
             seed: int = 0) -> list[TextRequest]:
    """gsp as text: G system prompts of random words, P questions each, in a seeded shuffled order."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))

    systems = [f"group {g}: " + words(system_words) for g in range(num_groups)]
    requests = [TextRequest(g, systems[g], words(question_words), output_len)
                for g in range(num_groups) for _ in range(per_group)]
    rng.shuffle(requests)
    return requests


def computed_tokens(before: Sequence[dict], after: Sequence[dict]) -> dict[str, int]:
    """Prompt tokens seen, cached and computed between two snapshots of each worker's engine stats."""
    prompt = sum(a["num_prompt_tokens"] - b["num_prompt_tokens"] for b, a in zip(before, after))
    cached = sum(a["num_cached_tokens"] - b["num_cached_tokens"] for b, a in zip(before, after))
    return {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": prompt - cached}


# -- client ------------------------------------------------------------------------------------


async def _one(client: Any, url: str, body: dict, headers: dict) -> dict[str, Any]:
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = time.perf_counter() - start
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - start}


async def run_stream(url: str, requests: Sequence[TextRequest], model: str, concurrency: int,
                     headers: dict | None = None,
                     on_done: Callable[[], object] = lambda: None) -> tuple[list[dict], float]:
    """All requests through `url`, at most `concurrency` in flight; (per-request timings, wall s).
    on_done() is called as each request finishes (a progress bar's update)."""
    import httpx

    queue = list(reversed(requests))
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            while queue:
                out.append(await _one(client, url, queue.pop().body(model), headers or {}))
                on_done()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out, time.perf_counter() - start


def summarize(side: str, timings: Sequence[dict], wall_s: float, tokens: dict[str, int]) -> dict[str, Any]:
    ttft = [t["ttft_s"] for t in timings if t["ttft_s"] is not None]
    prompt = tokens["prompt_tokens"]
    return {"side": side, "num_requests": len(timings), "wall_s": wall_s, "req_per_s": len(timings) / wall_s,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), **tokens,
            "hit_rate": tokens["cached_tokens"] / prompt if prompt else None}


# -- report ------------------------------------------------------------------------------------


def build_report(rows: Sequence[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    by_side = {r["side"]: r for r in rows}
    single = by_side.get("single", {}).get("computed_tokens")
    for row in rows:
        row["computed_vs_single"] = row["computed_tokens"] / single if single else None
    return {"config": config, "sides": list(rows)}


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"# Router bench: {cfg['replicas']} workers of model {cfg['model']} behind sglang-router "
             f"{cfg['router_version']}", "",
             f"`{cfg['command']}`", "",
             f"gsp as text: {cfg['workload']['num_groups']} groups x {cfg['workload']['per_group']} chat requests, "
             f"{cfg['workload']['system_words']}-word system prompts, {cfg['workload']['question_words']}-word "
             f"questions, {cfg['workload']['output_len']} output tokens; concurrency {cfg['concurrency']}; "
             f"{cfg['machine']['cpus']} CPU cores shared by every worker, the router and the client.", "",
             "| side | workers | hit rate | prompt tokens computed | vs single | req/s | TTFT p50 / p99 (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["sides"]:
        workers = 1 if r["side"] == "single" else cfg["replicas"]
        lines.append(f"| {r['side']} | {workers} | {_pct(r['hit_rate'])} | {r['computed_tokens']} | "
                     f"{_x(r['computed_vs_single'])} | {r['req_per_s']:.2f} | "
                     f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} |")
    if cfg.get("note"):
        lines += ["", cfg["note"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: BenchOutput) -> str:
    """Writes router_bench_MODEL.{json,md}; returns the Markdown."""
    return out.write_report(f"router_bench_{report['config']['model']}", report, markdown(report))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1000 * v:.0f}"


# -- driver ------------------------------------------------------------------------------------


def run_side(side: str, url: str, worker_urls: Sequence[str], requests: Sequence[TextRequest], model: str,
             concurrency: int, on_done: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """One side from emptied caches: warm-up request excluded, counters read around the stream."""
    for u in worker_urls:
        _flush(u)
    before = [_stats(u) for u in worker_urls]
    timings, wall_s = asyncio.run(run_stream(url, requests, model, concurrency, on_done=on_done))
    row = summarize(side, timings, wall_s, computed_tokens(before, [_stats(u) for u in worker_urls]))
    logger.info("%s: hit rate %.3f, %d prompt tokens computed, %.2f req/s", side, row["hit_rate"],
                row["computed_tokens"], row["req_per_s"])
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    from .harness import bench_model_path
    from ..frontend.router_proc import RouterProcess, free_port
    from ..frontend.spawn import ServerProcess

    started = time.perf_counter()
    requests = text_gsp(**args.workload, seed=args.seed)
    model_path = args.model_path or bench_model_path(args.model)
    common = ["--model", model_path, "--served-model-name", "bench", "--disable-log-requests",
              "--kv-cache-tokens", str(args.kv_cache_tokens), "--max-running-requests", str(args.concurrency)]
    env = {"OMP_NUM_THREADS": str(max(1, args.threads // args.replicas))}
    rows = []
    with progress(len(SIDES) * len(requests), "router bench", unit="req") as bar:
        single = ServerProcess([*common, "--num-threads", str(args.threads)],
                               env={"OMP_NUM_THREADS": str(args.threads)})
        try:
            asyncio.run(run_stream(single.url, requests[:2], "bench", 2))  # warm-up, flushed away below
            rows.append(run_side("single", single.url, [single.url], requests, "bench", args.concurrency, bar.update))
        finally:
            single.stop()
        replicas = ServerProcess([*common, "--replicas", str(args.replicas)], env=env, start_timeout_s=900)
        try:
            worker_urls = re.findall(r"worker \d+ ready on (http://[\d.]+:\d+)", replicas.log())
            asyncio.run(run_stream(replicas.url, requests[:2], "bench", 2))
            rows.append(run_side("cache_aware", replicas.url, worker_urls, requests, "bench", args.concurrency,
                                 bar.update))
            rr = RouterProcess(worker_urls, "127.0.0.1", free_port(), "round_robin", None)
            try:
                rr.wait_ready(len(worker_urls))
                rows.append(run_side("round_robin", rr.url, worker_urls, requests, "bench", args.concurrency,
                                     bar.update))
            finally:
                rr.stop(timeout=10)
        finally:
            replicas.stop()
    config = _config(args, model_path)
    config["elapsed_s"] = time.perf_counter() - started
    report = build_report(rows, config)
    out = BenchOutput("router_bench", args.out)
    out.finish(write_report(report, out))
    return report


def _stats(url: str) -> dict:
    import httpx

    return httpx.get(url + "/get_server_info", timeout=60).json()["stats"]


def _flush(url: str, timeout_s: float = 60.0) -> None:
    from .http_bench import _flush_server

    _flush_server(url, timeout_s)


def _config(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    import importlib.metadata

    argv = list(args.argv)
    if "--note" in argv[:-1]:
        argv[argv.index("--note") + 1] = "'(the note below)'"
    return {"command": " ".join(["python -m radixserve.bench.router_bench", *argv]), "model": args.model,
            "model_path": model_path, "replicas": args.replicas, "workload": args.workload, "seed": args.seed,
            "concurrency": args.concurrency, "threads": args.threads,
            "worker_threads": max(1, args.threads // args.replicas), "kv_cache_tokens": args.kv_cache_tokens,
            "router_version": importlib.metadata.version("sglang-router"), "note": args.note,
            "endpoint": "/v1/chat/completions (text, streamed)",
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("router_bench", __doc__)
    p.add_argument("--model", default="S", choices=tuple(PRESETS),
                   help="bench model (random weights, built once into the cache; tiny runs in seconds); it also "
                        "picks the workload's preset")
    p.add_argument("--model-path", default=None, help="a checkpoint directory to serve instead of the bench model")
    p.add_argument("--replicas", type=int, default=4, help="workers behind the router")
    add_gsp_flags(p, PRESETS)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (closed loop)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the single worker; each replica gets threads // replicas "
                        "(default: this machine's cores)")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="KV pool per worker, in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--note", default="", help="a sentence for the report (e.g. why a smaller configuration)")
    args = parse_args(p, argv)
    args.workload = {k: getattr(args, k) or v for k, v in PRESETS[args.model].items()}
    return args


if __name__ == "__main__":
    main()
