"""Shared-system-prompt benchmark: the same requests with the radix cache on and off, on one bench model.

    python -m radixserve.bench.run_prefix_bench            # reduced size, model M, a few minutes on a CPU
    python -m radixserve.bench.run_prefix_bench --size full

Writes prefix_bench.{json,md} (bench/output.py says where): computed prompt tokens, hit rate against the optimal
hit rate (ARCHITECTURE §12), requests/s and tokens/s (median of --runs after a warm-up) and the on/off ratio.
"Cache off" is `disable_radix_cache=True` and nothing else: same pool, same limits, same batches.
The pool holds every request's prompt and output without sharing, so neither side is short of KV
and the ratio measures the compute the cache saves.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
from typing import Any

from .harness import MODEL_HELP, bench_model_path, repeated_runs, stand_in_rounds
from .output import BenchOutput, bench_parser, parse_args, progress
from .workloads import SharedSystemPrompt

logger = logging.getLogger(__name__)

SIZES = {
    # groups, prompts per group, system, question, output
    "full": (8, 16, 1024, 64, 32),
    "reduced": (2, 16, 384, 16, 8),
    "tiny": (2, 8, 64, 8, 4),
}
TARGET_VS_OPTIMAL = 0.95
TARGET_SPEEDUP = 3.0
SPEEDUP_APPLIES_FROM = 0.85  # optimal hit rate from which the speed-up target applies


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    groups, per_group, system_len, question_len, output_len = SIZES[args.size]
    shape = dict(num_groups=args.groups or groups, per_group=args.per_group or per_group,
                 system_len=args.system_len or system_len, question_len=args.question_len or question_len,
                 output_len=args.output_len or output_len, seed=args.seed)
    make = lambda: SharedSystemPrompt(**shape)  # noqa: E731
    rounds = stand_in_rounds(make)
    kv_tokens = sum(len(p) + len(o) for items in rounds for p, o, _ in items)
    model_path = bench_model_path(args.model)
    engine_config = dict(kv_cache_tokens=kv_tokens, max_running_requests=args.max_running_requests,
                         chunked_prefill_size=args.chunked_prefill_size, num_threads=args.threads)
    from ..scheduler import Engine

    modes = {}
    with progress(2 * args.runs, "prefix bench") as bar:
        for mode, disable in (("cache_on", False), ("cache_off", True)):
            logger.info("%s: %d runs of gsp %s", mode, args.runs, shape)
            engine = Engine(model_path, disable_radix_cache=disable, **engine_config)
            summary, _ = repeated_runs(engine, make, {"mode": mode}, num_runs=args.runs, on_run=bar.update)
            engine.shutdown()
            modes[mode] = summary
    report = _report(args, shape, engine_config, model_path, modes)
    out = BenchOutput("prefix_bench", args.out)
    out.finish(out.write_report("prefix_bench", report, _markdown(report)))
    return report


def _report(args: argparse.Namespace, shape: dict, engine_config: dict, model_path: str,
            modes: dict[str, dict]) -> dict[str, Any]:
    on, off = modes["cache_on"], modes["cache_off"]
    ratio = on["req_per_s"] / off["req_per_s"] if off["req_per_s"] else None
    vs_optimal = on["hit_rate_vs_optimal"]
    checks = {
        "hit_rate_vs_optimal": vs_optimal,
        "hit_rate_vs_optimal_ok": vs_optimal is not None and vs_optimal >= TARGET_VS_OPTIMAL,
        "speedup": ratio,
        "speedup_applies": on["optimal_hit_rate"] >= SPEEDUP_APPLIES_FROM,
        "speedup_ok": ratio is not None and ratio >= TARGET_SPEEDUP,
    }
    return {
        "bench": "prefix_bench", "command": args.command,
        "model": args.model, "model_path": os.path.basename(model_path), "workload": {"name": "gsp", **shape},
        "engine": engine_config, "runs": args.runs, "threads": args.threads,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "cache_on": on, "cache_off": off, "checks": checks,
    }


def _markdown(r: dict[str, Any]) -> str:
    w, on, off, c = r["workload"], r["cache_on"], r["cache_off"], r["checks"]
    rows = []
    for name, s in (("cache on", on), ("cache off", off)):
        rows.append(f"| {name} | {s['prompt_tokens']} | {s['computed_tokens']} | {s['hit_rate']:.3f} | "
                    f"{s['optimal_hit_rate']:.3f} | {s['req_per_s']:.2f} | {s['tok_per_s']:.0f} | "
                    f"{s['ttft_s_p50']:.2f} / {s['ttft_s_p99']:.2f} |")
    applies = "applies" if c["speedup_applies"] else "does not apply (optimal < 85%)"
    return "\n".join([
        "# Shared-system-prompt bench: radix cache on vs off",
        "",
        f"Command: `{r['command'].strip()}`",
        "",
        f"Model {r['model']} (`{r['model_path']}`), gsp {w['num_groups']} groups x {w['per_group']} prompts, "
        f"system {w['system_len']} + question {w['question_len']} tokens, output {w['output_len']} "
        f"(greedy, ignore_eos), seed {w['seed']}. Engine {r['engine']}; {r['threads']} torch thread(s); "
        f"median of {r['runs']} runs after a warm-up; cache flushed before each run.",
        "",
        "| mode | prompt tokens | computed prompt tokens | hit rate | optimal | req/s | tokens/s | TTFT p50 / p99 (s) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- hit rate / optimal: **{c['hit_rate_vs_optimal']:.3f}** (target >= {TARGET_VS_OPTIMAL}: "
        f"{'met' if c['hit_rate_vs_optimal_ok'] else 'NOT met'})",
        f"- throughput on / off: **{c['speedup']:.2f}x** (target >= {TARGET_SPEEDUP}x, which {applies}: "
        f"{'met' if c['speedup_ok'] else 'NOT met'})",
        "",
        "Absolute times on a shared machine are noise; the on/off ratio comes from the same run.",
        "",
    ])


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("run_prefix_bench", __doc__)
    p.add_argument("--size", choices=sorted(SIZES), default="reduced",
                   help="workload size (groups x prompts per group, system / question / output tokens): "
                        + "; ".join(f"{k}: {g} x {n}, {s} / {q} / {o}" for k, (g, n, s, q, o) in SIZES.items()))
    p.add_argument("--model", default="M", help=MODEL_HELP)
    p.add_argument("--groups", type=int, help="groups of prompts that share one system prompt (default: the size's)")
    p.add_argument("--per-group", type=int, help="prompts per group (default: the size's)")
    p.add_argument("--system-len", type=int, help="tokens of each system prompt (default: the size's)")
    p.add_argument("--question-len", type=int, help="tokens after the system prompt, per prompt (default: the size's)")
    p.add_argument("--output-len", type=int, help="tokens generated per request (default: the size's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--runs", type=int, default=3, help="timed runs per mode; the report gives their median")
    p.add_argument("--max-running-requests", type=int, default=64, help="requests the engine runs at once")
    p.add_argument("--chunked-prefill-size", type=int, default=512, help="prompt tokens the engine computes per step")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (more than the free cores slows every thread down)")
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
