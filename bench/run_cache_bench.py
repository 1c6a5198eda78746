"""Cache-aware scheduling and eviction benchmark: scheduling policies x KV budgets x workloads, hit rate against
the optimal, cache on/off throughput, eviction, starvation and scheduling overhead, in one command (~20 min).

    python -m radixserve.bench.run_cache_bench                  # as recorded in bench/results (~20 min)
    python -m radixserve.bench.run_cache_bench --quick          # reduced sizes, no model M (a few minutes)

Sections of cache_bench.{json,md,png} (bench/output.py says where they go):
  grid      workloads x policies x KV budgets (25/50/100% of the workload's distinct tokens plus
            the running requests' decode room): hit rate vs the optimal, TTFT in engine steps.
            Hit rates depend on token ids only, so the grid runs on --hit-model (tiny by default).
  speed     per workload on --speed-model (M): default policy vs cache off at the 100% budget,
            requests/s and tokens/s (median of --runs after a warm-up), ratio, TTFT in seconds.
  eviction  lru vs lru-reuse under the default policy where they differ.
  starve    a hot stream with occasional cache misses: when each miss gets its first token,
            per policy, against fcfs.
  overhead  policy ordering time with thousands waiting; radix + scheduling time per step on
            --speed-model at batch 32.
"""
from __future__ import annotations

import argparse
import logging
import os
import platform
import time
from typing import Any, Callable

import torch

from ..scheduler.config import SCHEDULE_POLICIES
from .harness import MODEL_HELP, bench_model_path, budget_tokens, repeated_runs, run_workload
from .output import BenchOutput, bench_parser, parse_args, progress
from .report_cache import write_report
from .workloads import EVICTION_WORKLOADS, WORKLOAD_NAMES, MissStream, make_workload

logger = logging.getLogger(__name__)

BUDGETS = (0.25, 0.5, 1.0)
MAX_RUNNING = 64


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    started = time.time()
    report: dict[str, Any] = {
        "bench": "cache_bench", "command": args.command,
        "config": {k: v for k, v in vars(args).items() if k not in ("argv", "command")},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
    }
    hit_model = bench_model_path(args.hit_model)
    report["grid"] = grid(hit_model, args.workloads, args.policies, args.budgets, args.size)
    if "eviction" not in args.skip:
        report["eviction"] = eviction(hit_model, args.size)
    if "starve" not in args.skip:
        report["starve"] = starvation(hit_model)
    from .sched_overhead import ordering_cost, step_overhead

    if "overhead" not in args.skip:
        report["ordering_cost"] = ordering_cost(list(args.policies), [100, 1000, 5000])
    if "speed" not in args.skip:
        speed_model = bench_model_path(args.speed_model)
        report["speed"] = speed(speed_model, args.workloads, args.speed_size, args.runs)
        report["step_overhead"] = step_overhead(speed_model, batch=32)
    report["elapsed_s"] = time.time() - started
    out = BenchOutput("cache_bench", args.out)
    out.finish(write_report(report, out))
    return report


def grid(model_path: str, workloads: list[str], policies: list[str], budgets: list[float],
         size: str) -> list[dict[str, Any]]:
    rows = []
    cells = [(w, b, p) for w in workloads for b in budgets for p in policies]
    with progress(len(cells), "grid") as bar:
        for workload, budget, policy in cells:
            rows.append(_grid_cell(model_path, workload, budget, policy, size))
            bar.update()
    return rows


def _grid_cell(model_path: str, workload: str, budget: float, policy: str, size: str) -> dict[str, Any]:
    from ..scheduler import Engine

    make = _maker(workload, size)
    kv_tokens = budget_tokens(make, budget, MAX_RUNNING)
    engine = Engine(model_path, kv_cache_tokens=kv_tokens, schedule_policy=policy,
                    max_running_requests=MAX_RUNNING, num_threads=torch.get_num_threads())
    result = run_workload(engine, make())
    stats = engine.stats()
    engine.shutdown()
    summary = result.summary()
    return {
        "workload": workload, "policy": policy, "budget": budget, "kv_cache_tokens": kv_tokens,
        **{k: summary[k] for k in ("num_requests", "prompt_tokens", "computed_tokens", "hit_rate",
                                   "optimal_hit_rate", "hit_rate_vs_optimal", "num_steps",
                                   "ttft_steps_p50", "ttft_steps_p99")},
        "num_evicted_tokens": stats["num_evicted_tokens"], "num_retractions": stats["num_retractions"],
    }


def speed(model_path: str, workloads: list[str], size: str, num_runs: int) -> list[dict[str, Any]]:
    from ..scheduler import Engine

    rows = []
    with progress(2 * num_runs * len(workloads), "speed") as bar:
        for workload in workloads:
            make = _maker(workload, size)
            kv_tokens = budget_tokens(make, 1.0, MAX_RUNNING)
            row: dict[str, Any] = {"workload": workload, "size": size, "kv_cache_tokens": kv_tokens}
            for mode, disable in (("on", False), ("off", True)):
                engine = Engine(model_path, kv_cache_tokens=kv_tokens, max_running_requests=MAX_RUNNING,
                                disable_radix_cache=disable, num_threads=torch.get_num_threads())
                summary, _ = repeated_runs(engine, make, {}, num_runs=num_runs, on_run=bar.update)
                engine.shutdown()
                for key in ("hit_rate", "optimal_hit_rate", "req_per_s", "tok_per_s", "ttft_s_p50",
                            "ttft_s_p99", "wall_s_runs"):
                    row[f"{key}_{mode}"] = summary[key]
            row["speedup"] = row["req_per_s_on"] / row["req_per_s_off"]
            rows.append(row)
    return rows


def eviction(model_path: str, size: str) -> list[dict[str, Any]]:
    """lru vs lru-reuse under the default policy. Grid workloads use the §12 budgets; the hot-prefix
    stream uses pools of the hot prefix plus m one-off prompts (its distinct tokens are mostly
    one-offs, so fractions of them say little)."""
    from ..scheduler import Engine

    cells = []
    for workload in EVICTION_WORKLOADS:
        make = _maker(workload, size)
        if workload == "hotstream":
            p = make().params
            pools = [(f"hot+{m}x one-off", p["prefix_len"] + p["question_len"] + int(m * (p["oneoff_len"] + p["output_len"])))
                     for m in (2, 3, 4, 5)]
        else:
            pools = [(f"{b:.0%}", budget_tokens(make, b, MAX_RUNNING)) for b in (0.25, 0.5)]
        cells += [(workload, make, label, kv_tokens) for label, kv_tokens in pools]
    rows = []
    with progress(2 * len(cells), "eviction") as bar:
        for workload, make, label, kv_tokens in cells:
            row: dict[str, Any] = {"workload": workload, "budget": label, "kv_cache_tokens": kv_tokens}
            for policy in ("lru", "lru-reuse"):
                engine = Engine(model_path, kv_cache_tokens=kv_tokens, max_running_requests=MAX_RUNNING,
                                eviction_policy=policy, num_threads=torch.get_num_threads())
                summary = run_workload(engine, make()).summary()
                engine.shutdown()
                row[f"hit_rate_{policy}"] = summary["hit_rate"]
                row["optimal_hit_rate"] = summary["optimal_hit_rate"]
                bar.update()
            rows.append(row)
    return rows


def starvation(model_path: str) -> dict[str, Any]:
    """First-token step of every cache miss in a saturated hot stream, per policy, vs fcfs."""
    from ..scheduler import Engine
    from ..scheduler.policy import PolicyConfig

    variants = [("fcfs", "fcfs", {}), ("lpm", "lpm", {}), ("cache-aware", "cache-aware", {}),
                ("cache-aware, no starvation rule", "cache-aware", {"starvation_rule": "none"}),
                ("cache-aware, aging 32 steps", "cache-aware", {"starvation_rule": "aging", "max_wait_steps": 32}),
                ("cache-aware, overtake ratio 1.0", "cache-aware", {"overtake_ratio": 1.0})]
    shape = dict(num_steps=120, hot_per_step=1, miss_every=10)
    first: dict[str, dict[str, int]] = {}
    summaries: dict[str, dict] = {}
    with progress(len(variants), "starvation") as bar:
        for label, policy, cfg in variants:
            engine = Engine(model_path, kv_cache_tokens=20_000, schedule_policy=policy, max_running_requests=4,
                            num_threads=torch.get_num_threads(), policy=PolicyConfig(**cfg))
            result = run_workload(engine, MissStream(**shape))
            engine.shutdown()
            first[label] = {r.key: r.first_token_step for r in result.records if r.key.startswith("m")}
            summaries[label] = result.summary()
            bar.update()
    base = first["fcfs"]
    rows = []
    for label, _, _ in variants:
        mine = first[label]
        # Admission step = first-token step - 1 (a miss prefills in one step).
        rows.append({"variant": label,
                     "worst_admit_step_ratio": max((mine[k] - 1) / max(base[k] - 1, 1) for k in base),
                     "worst_wait_ratio": max((mine[k] - _arrival(k)) / max(base[k] - _arrival(k), 1) for k in base),
                     "hit_rate": summaries[label]["hit_rate"],
                     "ttft_steps_p50": summaries[label]["ttft_steps_p50"],
                     "ttft_steps_p99": summaries[label]["ttft_steps_p99"]})
    return {"workload": shape, "max_running_requests": 4, "rows": rows,
            "miss_first_token_steps": {label: dict(sorted(v.items(), key=lambda kv: _arrival(kv[0])))
                                       for label, v in first.items()}}


def _arrival(key: str) -> int:
    return int(key[1:])  # "m<step>"


def _maker(workload: str, size: str) -> Callable[[], Any]:
    return lambda: make_workload(workload, size)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("run_cache_bench", __doc__)
    p.add_argument("--size", default="full", choices=("full", "reduced", "tiny"),
                   help="workload size for the grid, eviction and starvation sections")
    p.add_argument("--speed-size", default="reduced", choices=("full", "reduced", "tiny"),
                   help="workload size for the cache on/off speed runs")
    p.add_argument("--hit-model", default="tiny",
                   help="model of the hit-rate sections (hit rates depend on the token ids only); " + MODEL_HELP)
    p.add_argument("--speed-model", default="M", help="model of the speed and step-overhead sections")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOAD_NAMES),
                   help="comma-separated workloads")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(SCHEDULE_POLICIES),
                   help="comma-separated scheduling policies")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=list(BUDGETS),
                   help="comma-separated KV budgets, as fractions of each workload's distinct tokens")
    p.add_argument("--runs", type=int, default=3, help="timed runs per speed measurement; the report gives their median")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (more than the free cores slows every thread down)")
    p.add_argument("--skip", type=lambda s: s.split(","), default=[],
                   help="comma-separated sections to leave out: eviction, starve, overhead, speed (speed = every "
                        "run on the speed model)")
    p.add_argument("--quick", action="store_true", help="reduced sizes and no speed section (a few minutes)")
    args = parse_args(p, argv)
    if args.quick:
        args.size = "reduced"
        args.skip = sorted(set(args.skip) | {"speed"})
    return args


if __name__ == "__main__":
    main()
