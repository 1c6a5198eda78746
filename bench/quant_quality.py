"""Quality of quantized weights and the int8 KV cache on a trained model: the demo model's held-out evaluation
(bench/demo_kit/eval_cases.py: every set, its checks, the chat template) served by the in-process Engine, greedy,
in each configuration, against full precision (fp32, as the demo ships).

A configuration is its parts joined by "+": a dtype (fp32, the default, or bf16), a weight quantization (int8,
int8-g32, int4, int4-g128: --quantization) and kv-int8 (--kv-cache-dtype int8). Each runs in a fresh Engine; every
prompt of a set is submitted at once. Per configuration: right / total per set, the score in points (percent of
all cases), its difference from fp32's in points, how many replies are token for token fp32's, and how many of the
engine's linears (fused qkv, o, gate_up, down per layer, and the LM head) run quantized and how many stay in float
(a weight whose input size is not a multiple of the group stays float; the engine warns). Issue 39's thresholds:
int8 weights or the int8 KV cache within 1 point of fp32, int4 weights within 5.

    python -m radixserve.bench.quant_quality --out bench/results
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from .output import BenchOutput, bench_parser, comma_choices, parse_args, progress

CONFIGS = ("fp32", "bf16", "int8", "int8-g32", "int4", "int4-g128", "kv-int8", "int4+kv-int8", "bf16+int8",
           "bf16+int4", "bf16+kv-int8")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
THRESHOLDS = {"int8": 1.0, "int4": 5.0}  # points of the overall score below fp32's, at most (issue 39)
MAX_NEW = 64  # as eval_cases.evaluate


def engine_config(name: str, threads: int) -> dict[str, Any]:
    """The Engine keywords of a configuration name (see the module docstring)."""
    config: dict[str, Any] = {"dtype": "float32", "num_threads": threads, "kv_cache_tokens": 65536,
                              "max_running_requests": 128}
    for part in name.split("+"):
        if part in DTYPES:
            config["dtype"] = DTYPES[part]
        elif part == "kv-int8":
            config["kv_cache_dtype"] = "int8"
        else:
            config["quantization"] = part
    return config


def threshold(name: str) -> float | None:
    """The largest drop issue 39 allows a configuration: 5 points with int4 weights, 1 with int8 weights or the
    int8 KV cache only; None for float weights and KV (no threshold)."""
    parts = name.split("+")
    if any(p.startswith("int4") for p in parts):
        return THRESHOLDS["int4"]
    if any(p.startswith("int8") or p == "kv-int8" for p in parts):
        return THRESHOLDS["int8"]
    return None


def linear_counts(engine: Any) -> dict[str, Any]:
    """How many of the engine's linears run on quantized weights and which stay in float."""
    model = engine.runner.model
    named = [("lm_head", model.lm_head)] + [(f"layers.{i}.{n}", getattr(layer, n)) for i, layer in
                                            enumerate(model.layers) for n in ("qkv", "o", "gate_up", "down")]
    floats = [n for n, lin in named if lin.quant is None]
    return {"quantized": len(named) - len(floats), "float": len(floats), "float_names": floats}


def run_config(name: str, model_path: str, sets: dict[str, list], threads: int) -> dict[str, Any]:
    """Greedy replies to every case in one configuration: per set the output ids and which checks passed."""
    from ..scheduler import Engine, SamplingParams

    engine = Engine(model_path, **engine_config(name, threads))
    try:
        tok = engine.tokenizer
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
        per_set = {}
        for set_name, cases in sets.items():
            prompts = [tok.apply_chat_template(messages, tools=tools) for messages, tools, _ in cases]
            results = engine.generate(prompts, params)
            texts = [tok.decode(r.output_ids, skip_special_tokens=True) for r in results]
            per_set[set_name] = {"right": [bool(check(t)) for (_, _, check), t in zip(cases, texts)],
                                 "output_ids": [list(r.output_ids) for r in results]}
        kv = engine.runner.k_cache
        return {"config": name, "engine": engine_config(name, threads), "linears": linear_counts(engine),
                "runtime": {"dtype": str(engine.runner.dtype).removeprefix("torch."),
                            "kv_cache": str(kv.dtype).removeprefix("torch.") if hasattr(kv, "dtype")
                            else type(kv).__name__},
                "sets": per_set}
    finally:
        engine.shutdown()


def score(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """A run's right / total per set, its score in points, the difference from `base`'s, the replies identical
    to base's token for token, and whether issue 39's threshold (if any) holds."""
    right = sum(sum(s["right"]) for s in run["sets"].values())
    total = sum(len(s["right"]) for s in run["sets"].values())
    base_right = sum(sum(s["right"]) for s in base["sets"].values())
    points, base_points = 100.0 * right / total, 100.0 * base_right / total
    differ = {n: [i for i, (a, b) in enumerate(zip(s["output_ids"], base["sets"][n]["output_ids"])) if a != b]
              for n, s in run["sets"].items()}
    identical = total - sum(len(d) for d in differ.values())
    limit = threshold(run["config"])
    diff = points - base_points
    return {"config": run["config"], "engine": run["engine"], "runtime": run["runtime"], "linears": run["linears"],
            "sets": {n: f"{sum(s['right'])}/{len(s['right'])}" for n, s in run["sets"].items()},
            "right": right, "total": total, "points": round(points, 2), "diff_points": round(diff, 2),
            "identical": identical, "differing": {n: d for n, d in differ.items() if d}, "threshold_points": limit,
            "meets_threshold": None if limit is None else diff >= -limit - 1e-9,
            "sets_lost": {n: lost for n, s in run["sets"].items()
                          if (lost := sum(base["sets"][n]["right"]) - sum(s["right"])) > 0}}


def markdown(report: dict[str, Any]) -> str:
    rows = report["configs"]
    sets = list(rows[0]["sets"])
    lines = [f"# Held-out quality of quantized weights and the int8 KV cache: {report['model']}", "",
             f"`{report['command']}`", "",
             "Greedy (temperature 0, at most 64 new tokens) replies of the in-process Engine to every held-out "
             "case of bench/demo_kit/eval_cases.py, each set submitted at once; `vs fp32`: the score's difference "
             "from fp32's in points; `same tokens`: replies identical to fp32's token for token; `linears q / "
             "float`: the engine's linears (fused qkv, o, gate_up, down per layer, the LM head) on quantized "
             "weights / left in float (input size not a multiple of the group). Issue 39: int8 weights and the "
             f"int8 KV cache within {THRESHOLDS['int8']:g} point of fp32, int4 weights within "
             f"{THRESHOLDS['int4']:g}. Quantized kernel on this machine: {report['quant_kernel']}.", "",
             "| config | score | vs fp32 | same tokens | linears q / float | threshold | met |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        limit = "" if r["threshold_points"] is None else f"-{r['threshold_points']:g}"
        met = "" if r["meets_threshold"] is None else ("yes" if r["meets_threshold"] else "**no**")
        lines.append(f"| {r['config']} | {r['right']}/{r['total']} ({r['points']:.1f}) | {r['diff_points']:+.1f} | "
                     f"{r['identical']}/{r['total']} | {r['linears']['quantized']} / {r['linears']['float']} | "
                     f"{limit} | {met} |")
    lines += ["", "Right / total per set:", "", "| config | " + " | ".join(sets) + " |",
              "|---|" + "---|" * len(sets)]
    lines += [f"| {r['config']} | " + " | ".join(r["sets"][s] for s in sets) + " |" for r in rows]
    floats = {r["config"]: r["linears"]["float_names"] for r in rows if r["linears"]["float"] and
              r["engine"].get("quantization")}
    differ = {r["config"]: r["differing"] for r in rows if r["differing"]}
    if differ:
        lines += ["", "Replies not token for token fp32's (set: case indices): " + "; ".join(
            f"{c}: " + ", ".join(f"{n} {d}" for n, d in sets_.items()) for c, sets_ in differ.items()) + "."]
    if floats:
        lines += ["", "Left in float: " + "; ".join(f"{c}: {', '.join(n)}" for c, n in floats.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, sets: dict[str, list] | None = None) -> dict[str, Any]:
    """`sets` replaces the held-out case sets (the tests' few cases)."""
    args = _parse(argv)
    import torch

    from ..kernels import quant_linear
    from .demo_kit.eval_cases import case_sets
    from .harness import bench_model_path

    torch.set_num_threads(args.threads)
    path = bench_model_path(args.model)
    sets = sets if sets is not None else case_sets()
    names = ["fp32"] + [c for c in args.configs if c != "fp32"]
    runs = []
    with progress(len(names), "configs", unit="config") as bar:
        for name in names:
            runs.append(run_config(name, path, sets, args.threads))
            bar.update()
    report = {"bench": "quant_quality", "command": args.command, "model": args.model, "path": path,
              "quant_kernel": quant_linear.kernel(), "threads": args.threads,
              "configs": [score(r, runs[0]) for r in runs]}
    out = BenchOutput("quant_quality", args.out)
    out.finish(out.write_report("quant_quality", report, markdown(report)))
    return report


def _parse(argv: Sequence[str] | None) -> Any:
    p = bench_parser("quant_quality", __doc__)
    p.add_argument("--model", default="demo", help="demo (the built-in trained model), a bench model (tiny, S, ...) "
                                                    "or a checkpoint directory")
    p.add_argument("--configs", type=comma_choices(CONFIGS), default=list(CONFIGS),
                   help="configurations to run (fp32, the reference, always runs first)")
    p.add_argument("--threads", type=int, default=1)
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
