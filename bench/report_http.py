"""http_bench's report: run records -> one row per concurrency level (medians per side, HTTP /
offline ratios), Markdown and a PNG (bench/http_bench.py measures; this module only aggregates and writes)."""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from .output import BenchOutput

SIDES = ("http", "offline")
TARGETS = {"S": 0.8, "M": 0.9}  # HTTP / offline req/s, to show (not asserted)
# The numbers every run summary has (the aggregation takes their medians).
SUMMARY_KEYS = ("num_requests", "wall_s", "req_per_s", "tok_per_s", "output_tok_per_s", "prompt_tokens",
                "cached_tokens", "output_tokens", "hit_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


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
              f"![HTTP / offline]({stem(report)}.png)", ""]
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


def stem(report: dict[str, Any]) -> str:
    return f"http_bench_{report['config']['model']}"


def write_report(report: dict[str, Any], out: BenchOutput) -> str:
    """Writes http_bench_MODEL.{json,png,md}; returns the Markdown."""
    return out.write_report(stem(report), report, markdown(report), lambda path: plot(report, path))
