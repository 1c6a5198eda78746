"""Stored conversations vs resent history: N agents x T turns through /v1/responses with previous_response_id,
and the same conversations through /v1/chat/completions with the whole history resent each turn.

    python -m radixserve.bench.responses_bench --model S            # 8 agents x 6 turns, 3 rounds

One server; the two modes alternate within the invocation (the cache flushed before each run), each agent
runs its turns in order and the agents run concurrently. Reported per mode, median of the rounds: req/s, the
prompt tokens sent, the cached ones (hit rate = cached / prompt), and latency p50 / p99. The chat mode resends
the assistant's text, which the tokenizer need not split as the model wrote it; the responses mode continues
from the exact token ids the server stored. Greedy, ignore_eos, so every turn generates --output-tokens.
Writes responses_bench_MODEL.{json,md} (bench/output.py says where).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import time
from typing import Any, Callable

from .harness import MODEL_HELP
from .output import BenchOutput, bench_parser, parse_args, percentile, progress

logger = logging.getLogger(__name__)
MODES = ("responses", "chat")
_WORDS = ("plan", "search", "file", "result", "agent", "tool", "error", "retry", "summary", "update", "check",
          "report", "data", "query", "step", "value", "list", "node", "cache", "route")


def conversation(agent: int, turns: int, words_per_turn: int, seed: int) -> list[str]:
    rng = random.Random(seed * 1000 + agent)
    return [f"Agent {agent}, step {t}: " + " ".join(rng.choice(_WORDS) for _ in range(words_per_turn))
            for t in range(turns)]


def instructions(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return "You are a careful agent. " + " ".join(rng.choice(_WORDS) for _ in range(words))


async def _agent(client: Any, mode: str, system: str, inputs: list[str], output_tokens: int,
                 records: list[dict[str, Any]], on_turn: Callable[[], object]) -> None:
    sampling = {"temperature": 0, "ignore_eos": True}
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    previous = None
    for text in inputs:
        start = time.perf_counter()
        if mode == "responses":
            body = {"instructions": system, "input": text, "previous_response_id": previous,
                    "max_output_tokens": output_tokens, **sampling}
            r = (await client.post("/v1/responses", json=body)).raise_for_status().json()
            previous = r["id"]
            usage = r["usage"]
            prompt, cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
        else:
            history.append({"role": "user", "content": text})
            body = {"messages": history, "max_tokens": output_tokens, **sampling}
            r = (await client.post("/v1/chat/completions", json=body)).raise_for_status().json()
            history.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
            usage = r["usage"]
            prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        records.append({"prompt": prompt, "cached": cached, "latency_s": time.perf_counter() - start})
        on_turn()


async def run_mode(url: str, mode: str, system: str, convs: list[list[str]], output_tokens: int,
                   on_turn: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """Every conversation through `mode`, the agents concurrently; on_turn() after each request."""
    import httpx

    records: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*(_agent(client, mode, system, c, output_tokens, records, on_turn) for c in convs))
        wall = time.perf_counter() - start
    prompt, cached = sum(r["prompt"] for r in records), sum(r["cached"] for r in records)
    latencies = [r["latency_s"] for r in records]
    return {"mode": mode, "requests": len(records), "wall_s": wall, "req_per_s": len(records) / wall,
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99)}


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        row = {"mode": mode, "runs": len(mine)}
        for key in ("req_per_s", "hit_rate", "prompt_tokens", "cached_tokens", "latency_p50_s", "latency_p99_s"):
            row[key] = statistics.median(r[key] for r in mine)
        row["req_per_s_min"] = min(r["req_per_s"] for r in mine)
        row["req_per_s_max"] = max(r["req_per_s"] for r in mine)
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [f"# /v1/responses (previous_response_id) vs chat completions (history resent), model {c['model']}", "",
             f"{c['agents']} agents x {c['turns']} turns, {c['output_tokens']} output tokens per turn, "
             f"{c['runs']} alternating rounds, median. Command: `{c['command']}`", "",
             "| mode | req/s (min–max) | hit rate | prompt tokens | cached tokens | latency p50 / p99 |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['mode']} | {r['req_per_s']:.2f} ({r['req_per_s_min']:.2f}–{r['req_per_s_max']:.2f}) | "
                     f"{r['hit_rate']:.3f} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | "
                     f"{r['latency_p50_s'] * 1e3:.0f} / {r['latency_p99_s'] * 1e3:.0f} ms |")
    ratio = report.get("req_per_s_ratio")
    if ratio is not None:
        lines += ["", f"responses / chat req/s: **{ratio:.2f}x**"]
    return "\n".join(lines) + "\n"


def build_report(runs: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    rows = aggregate(runs)
    by_mode = {r["mode"]: r for r in rows}
    ratio = None
    if len(by_mode) == 2 and by_mode["chat"]["req_per_s"]:
        ratio = by_mode["responses"]["req_per_s"] / by_mode["chat"]["req_per_s"]
    return {"config": config, "rows": rows, "runs": runs, "req_per_s_ratio": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from .harness import bench_model_path
    from .http_bench import _flush_server
    from ..frontend.spawn import ServerProcess

    system = instructions(args.instruction_words, args.seed)
    convs = [conversation(a, args.turns, args.words_per_turn, args.seed) for a in range(args.agents)]
    server = ServerProcess(["--model", bench_model_path(args.model), "--num-threads", str(args.threads),
                            "--max-running-requests", str(max(8, args.agents))],
                           env={"OMP_NUM_THREADS": str(args.threads)})
    runs = []
    try:
        asyncio.run(run_mode(server.url, "chat", system, convs[:1], 2))  # warm-up
        with progress(args.runs * len(MODES) * args.agents * args.turns, "responses bench", unit="req") as bar:
            for rep in range(args.runs):
                for mode in MODES if rep % 2 == 0 else tuple(reversed(MODES)):
                    _flush_server(server.url)
                    run = asyncio.run(run_mode(server.url, mode, system, convs, args.output_tokens, bar.update))
                    runs.append(dict(run, rep=rep))
                    logger.info("rep %d %s: %.2f req/s, hit rate %.3f", rep, mode, run["req_per_s"], run["hit_rate"])
    finally:
        server.stop()
    config = {"command": args.command, "model": args.model,
              "agents": args.agents, "turns": args.turns, "output_tokens": args.output_tokens, "runs": args.runs,
              "threads": args.threads, "instruction_words": args.instruction_words,
              "words_per_turn": args.words_per_turn, "cpus": os.cpu_count()}
    report = build_report(runs, config)
    out = BenchOutput("responses_bench", args.out)
    out.finish(out.write_report(f"responses_bench_{args.model}", report, markdown(report)))
    return report


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("responses_bench", __doc__)
    p.add_argument("--model", default="S", help=MODEL_HELP)
    p.add_argument("--agents", type=int, default=8, help="conversations running at once")
    p.add_argument("--turns", type=int, default=6, help="user turns per conversation")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--instruction-words", type=int, default=200, help="words of the shared system instructions")
    p.add_argument("--words-per-turn", type=int, default=30, help="words of each user turn")
    p.add_argument("--runs", type=int, default=3,
                   help="rounds per mode, the modes alternating; the report gives their median")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.add_argument("--seed", type=int, default=0, help="seed of the random words")
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
