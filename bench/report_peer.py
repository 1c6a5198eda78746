"""Summaries, JSON, Markdown and PNG of the vLLM peer bench (see peer_vllm)."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..radix.optimal import optimal_counts
from .output import BenchOutput
from .roofline import FORMULA, linear_flops

OURS = "radixserve"  # the reference engine's name in rows


def build_report(measures: Sequence[Any], model_config: dict[str, Any] | None, roof: dict[str, Any] | None,
                 engines: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    rows = summarize(measures, model_config, roof)
    return {"bench": "peer_vllm", **meta, "engines": engines, "roofline": roof,
            "flops_formula": FORMULA if roof else None, "rows": rows, "ratios": ratios(rows)}


def summarize(measures: Sequence[Any], model_config: dict[str, Any] | None = None,
              roof: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per (workload, engine): medians over the repetitions, counts from the first run."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for m in measures:
        groups.setdefault((m.workload, m.engine), []).append(m)
    refs = {w: min(ms, key=lambda m: m.rep) for (w, e), ms in groups.items() if e == OURS}
    rows = [_row(sorted(ms, key=lambda m: m.rep), refs.get(w), model_config, roof) for (w, e), ms in groups.items()]
    best = ratios(rows)
    for row in rows:
        ref = best.get(row["workload"])
        row["vs_best_peer"] = row["req_per_s"] / ref["best_peer_req_per_s"] if ref else None
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload: the vLLM block size with the best median req/s, and ours / that."""
    out: dict[str, dict[str, Any]] = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        peers = [r for r in rows if r["workload"] == w and r["engine"] != OURS]
        ours = next((r for r in rows if r["workload"] == w and r["engine"] == OURS), None)
        if not peers:
            continue
        best = max(peers, key=lambda r: r["req_per_s"])
        out[w] = {"best_peer": best["engine"], "best_peer_req_per_s": best["req_per_s"],
                  "ours_req_per_s": ours["req_per_s"] if ours else None,
                  "ours_over_best": ours["req_per_s"] / best["req_per_s"] if ours else None}
    return out


def _row(ms: list[Any], ref: Any, model_config: dict[str, Any] | None, roof: dict[str, Any] | None) -> dict[str, Any]:
    first = ms[0]
    walls = [m.wall_s for m in ms]
    req = [len(m.prompts) / m.wall_s for m in ms]
    tok = [(m.prompt_tokens + m.output_tokens) / m.wall_s for m in ms]
    cached = first.cached_tokens
    row: dict[str, Any] = {
        "workload": first.workload, "engine": first.engine, "num_runs": len(ms), "num_requests": len(first.prompts),
        "prompt_tokens": first.prompt_tokens, "output_tokens": first.output_tokens, "cached_tokens": cached,
        "hit_rate": cached / first.prompt_tokens if cached is not None and first.prompt_tokens else None,
        "optimal_hit_rate": optimal_counts(first.rounds()).hit_rate,
        "counts_vary": len({m.cached_tokens for m in ms}) > 1,
        "outputs_stable": all(m.outputs == first.outputs for m in ms),
        "wall_s": statistics.median(walls), "wall_s_runs": walls,
        "req_per_s": statistics.median(req), "req_per_s_min": min(req), "req_per_s_max": max(req),
        "tok_per_s": statistics.median(tok), "tok_per_s_min": min(tok), "tok_per_s_max": max(tok),
    }
    row.update(_compare_outputs(ref, first))
    if all(m.profile for m in ms):  # radixserve: median share of each step part over the runs
        parts = [k for k in ms[0].profile if k not in ("step", "steps", "shared_prefix_steps")]
        row["step_profile"] = {k: statistics.median(m.profile[k] / m.profile["step"] for m in ms) for k in parts}
        row["step_profile"]["unaccounted"] = statistics.median(1 - sum(m.profile[k] for k in parts) / m.profile["step"]
                                                               for m in ms)
        row["steps"] = first.profile["steps"]
        row["shared_prefix_steps"] = first.profile["shared_prefix_steps"]
    if roof and model_config and cached is not None:
        forward = first.prompt_tokens - cached + first.output_tokens
        gflops = linear_flops(model_config, forward) / row["wall_s"] / 1e9
        row.update(forward_tokens=forward, linear_gflops=gflops, roofline_fraction=gflops / roof["gflops"])
    return row


def _compare_outputs(ref: Any, run: Any) -> dict[str, Any]:
    """Greedy outputs against radixserve's first run, request by request (keys name requests)."""
    if ref is None or run.engine == OURS:
        return {"outputs_match_ours": None, "num_outputs_differ": None, "first_differ": None}
    theirs = dict(zip(run.keys, run.outputs))
    differ = [k for k, out in zip(ref.keys, ref.outputs) if theirs.get(k) != out]
    return {"outputs_match_ours": not differ, "num_outputs_differ": len(differ),
            "first_differ": differ[0] if differ else None}


def report_name(report: dict[str, Any]) -> str:
    """peer_vllm_MODEL, with _bf16 when the engines ran bf16 (fp32 runs keep their earlier names)."""
    dtype = report.get("dtype", "float32")
    return f"peer_vllm_{report.get('model')}" + ("" if dtype == "float32" else "_bf16")


def write_report(report: dict[str, Any], out: BenchOutput) -> str:
    """Writes peer_vllm_MODEL.{json,png,md}; returns the Markdown."""
    title = f"model {report.get('model')} ({report.get('dtype', 'float32')}), {report.get('size')} workloads"
    return out.write_report(report_name(report), report, markdown(report),
                            lambda path: plot_peer(report["rows"], path, title=title))


_HEAD = ("| workload | engine | req/s median (min–max) | tok/s median | hit rate | optimal | outputs = ours "
         "| vs best vLLM |")


def markdown(r: dict[str, Any]) -> str:
    roof = r.get("roofline")
    head, sep = _HEAD, "|---|---|---|---|---|---|---|---|"
    if roof:
        head, sep = head + " linear GFLOP/s | of roofline |", sep + "---|---|"
    command = (f"Command: `{r.get('command', '').strip()}` ({r.get('elapsed_s', 0) / 60:.1f} min). "
               f"Machine {r.get('machine')}, {r.get('threads')} thread(s) per engine.")
    lines = ["# radixserve vs vLLM-CPU (same checkpoints, same token ids)", "", command, "",
             *_method(r), "", head, sep]
    lines += [_table_line(row, bool(roof)) for row in r["rows"]]
    lines.append("")
    for w, x in r.get("ratios", {}).items():
        if x["ours_over_best"] is not None:
            lines.append(f"- {w}: radixserve / best vLLM ({x['best_peer']}) = **{x['ours_over_best']:.2f}x**")
    if roof:
        lines += ["", (f"Roofline: the best {roof.get('dtype', 'float32')} matmul at the model's layer shapes, {roof['threads']} thread(s) "
                       f"({roof.get('method', 'torch.matmul')} at {roof['num_tokens']} tokens; the best of "
                       "torch.matmul and the engine's packed linear at 512 and 4096 tokens): "
                       f"**{roof['gflops']:.1f} GFLOP/s**. {r['flops_formula']}; "
                       "GFLOP/s = linear FLOPs / median wall time.")]
    lines += _step_bytes_lines(r.get("decode_step_bytes") or {}, r.get("ratios", {}))
    lines += _profile_lines(r["rows"])
    lines += ["", *_engines(r), "", f"![throughput and hit rate]({report_name(r)}.png)", ""]
    return "\n".join(lines)


def _step_bytes_lines(step_bytes: dict[str, dict[str, float]], ratios: dict[str, Any]) -> list[str]:
    """What one decode step reads on each workload (bench.roofline.decode_step_bytes), beside the ratio."""
    if not step_bytes:
        return []
    lines = ["", "Bytes one decode step reads, averaged over the workload's decode steps: the weights (linears and "
             "LM head), and the running requests' K/V read once per request or once per shared prefix:", "",
             "| workload | weights MB | K/V MB, per request | K/V MB, prefix once | radixserve / best vLLM |",
             "|---|---|---|---|---|"]
    for w, b in step_bytes.items():
        x = (ratios.get(w) or {}).get("ours_over_best")
        lines.append(f"| {w} | {b['weights'] / 1e6:,.0f} | {b['kv_per_request'] / 1e6:,.0f} | "
                     f"{b['kv_prefix_once'] / 1e6:,.0f} | {'-' if x is None else f'{x:.2f}x'} |")
    return lines


def _profile_lines(rows: list[dict[str, Any]]) -> list[str]:
    """radixserve's step profile: the share of step time in each part (median over the runs)."""
    ours = [row for row in rows if row.get("step_profile")]
    if not ours:
        return []
    parts = list(ours[0]["step_profile"])
    lines = ["", "Step profile of radixserve (share of step wall time, median over runs; all host work is in "
             "plan + build + sample + outputs):", "", "| workload | steps | shared-prefix steps | "
             + " | ".join(parts) + " |", "|---|---|---|" + "---|" * len(parts)]
    for row in ours:
        shares = " | ".join(f"{100 * row['step_profile'][p]:.1f}%" for p in parts)
        lines.append(f"| {row['workload']} | {row['steps']} | {row['shared_prefix_steps']} | {shares} |")
    return lines


def _method(r: dict[str, Any]) -> list[str]:
    order = ", ".join(r.get("engines", {})) or "the engines"
    return [(f"Model {r.get('model')} (`{r.get('model_path')}`, {r.get('dtype', 'float32')}), {r.get('size')} "
             f"workloads, seed {r.get('seed')}; "
             f"greedy, ignore_eos. Each engine is warmed up once, then runs each workload "
             f"{r.get('warmup_runs', 0)} time(s) untimed; per workload the engines run in the order {order}, "
             "reversed every other repetition, each run from an emptied prefix cache after "
             f"{r.get('settle_s', 0):g} s idle "
             f"(flush_cache / reset_prefix_cache); median of {r.get('reps')} runs (min–max). Rounds go one "
             "generate call at a time; round r+1 is built from the same engine's round-r outputs. "
             "tok/s = all prompt tokens (cached included) + outputs, over the summed generate time. "
             "Hit rate = Σ cached / Σ prompt tokens (ours: GenerateResult.cached_tokens, page size 1; vLLM: "
             "RequestOutput.num_cached_tokens, whole blocks only); optimal = §12 (page size 1, infinite cache). "
             "vs best vLLM = median req/s / that of the faster vLLM block size. "
             "'outputs = ours': greedy outputs equal radixserve's, request by request (n differ otherwise). "
             "Absolute times on a shared machine are noise; compare the ratios.")]


def _table_line(row: dict[str, Any], with_roof: bool) -> str:
    hit = "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}"
    if row["outputs_match_ours"] is None:
        same = "(reference)"
    else:
        same = "yes" if row["outputs_match_ours"] else f"no ({row['num_outputs_differ']} differ)"
    vs = "-" if row.get("vs_best_peer") is None else f"{row['vs_best_peer']:.2f}x"
    bold = "**" if row["engine"] == OURS else ""
    line = (f"| {row['workload']} | {bold}{row['engine']}{bold} | {row['req_per_s']:.2f} "
            f"({row['req_per_s_min']:.2f}–{row['req_per_s_max']:.2f}) | {row['tok_per_s']:.0f} | {hit} | "
            f"{row['optimal_hit_rate']:.3f} | {same} | {vs} |")
    if with_roof:
        frac = row.get("roofline_fraction")
        line += (" - | - |" if frac is None else f" {row['linear_gflops']:.1f} | {frac:.1%} |")
    return line


def _engines(r: dict[str, Any]) -> list[str]:
    lines = ["Engines:", ""]
    for name, info in r.get("engines", {}).items():
        if "llm" in info:
            lines.append(f"- {name}: vLLM {info.get('vllm_version')} `LLM({_kwargs(info.get('llm') or {})})`, "
                         f"started in {info.get('startup_s', 0):.0f} s")
        else:
            lines.append(f"- {name}: `Engine({_kwargs(info.get('engine') or {})})`")
    return lines


def _kwargs(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in d.items() if k != "model")


def _plot_base(row: dict[str, Any], ours: dict[str, Any] | None) -> float:
    """The req/s that bars are divided by: the best vLLM's, else ours, else the row's own."""
    if row.get("vs_best_peer"):
        return row["req_per_s"] / row["vs_best_peer"]
    return (ours or row)["req_per_s"]


def plot_peer(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Left: median req/s relative to the best vLLM block size (bars: min–max); right: hit rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    cell = {(r["workload"], r["engine"]): r for r in rows}
    width = 0.8 / max(1, len(engines))
    fig, (ax_t, ax_h) = plt.subplots(2, 1, figsize=(max(7.0, 1.4 * len(workloads)), 6.4))
    for num, engine in enumerate(engines):
        xs, rel, err, hits = [], [], [[], []], []
        for i, w in enumerate(workloads):
            row = cell.get((w, engine))
            if row is None:
                continue
            base = _plot_base(row, cell.get((w, OURS)))
            xs.append(i + (num - (len(engines) - 1) / 2) * width)
            rel.append(row["req_per_s"] / base)
            err[0].append((row["req_per_s"] - row["req_per_s_min"]) / base)
            err[1].append((row["req_per_s_max"] - row["req_per_s"]) / base)
            hits.append(row["hit_rate"] or 0.0)
        ax_t.bar(xs, rel, width, yerr=err, capsize=2, label=engine)
        ax_h.bar(xs, hits, width, label=engine)
    for i, w in enumerate(workloads):
        opt = max(r["optimal_hit_rate"] for r in rows if r["workload"] == w)
        ax_h.hlines(opt, i - 0.45, i + 0.45, colors="gray", linestyles="--", linewidth=1)
    for ax, label in ((ax_t, "req/s / best vLLM"), (ax_h, "hit rate (dashed: optimal)")):
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    ax_t.axhline(1.0, color="black", linewidth=0.8)
    ax_h.set_ylim(0, 1.0)
    ax_t.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
