"""Summaries, JSON and Markdown of the llama.cpp peer bench (see peer_llamacpp): pure functions of the recorded
runs, so CI checks them on recorded rows without llama.cpp."""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from .output import BenchOutput
from .report_peer import OURS

LLAMA = "llama.cpp"
ENGINES = (OURS, LLAMA)
_TIMED = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")


def build_report(runs: Sequence[dict[str, Any]], sweep: Sequence[dict[str, Any]], single: Sequence[dict[str, Any]],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """runs: one record per timed run (engine, workload, rep, settings, req_per_s, TTFT/TPOT percentiles in
    seconds, prompt/cached/computed tokens, optimal_hit_rate); sweep: llama.cpp's one-run tries per workload;
    single: single-stream records (engine, rep, prefill_tok_s, decode_tok_s)."""
    rows = summarize(runs)
    return {"bench": "peer_llamacpp", **meta, "rows": rows, "ratios": ratios(rows),
            "sweep": [_sweep_row(r) for r in sweep], "single_stream": summarize_single(single),
            "records": list(runs), "single_records": list(single)}


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, engine), in the order first seen: medians over the runs."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["engine"]), []).append(run)
    return [_row(sorted(rs, key=lambda r: r["rep"])) for rs in groups.values()]


def _row(rs: list[dict[str, Any]]) -> dict[str, Any]:
    first = rs[0]
    req = [r["req_per_s"] for r in rs]
    computed = [r["computed_tokens"] for r in rs]
    row: dict[str, Any] = {
        "workload": first["workload"], "engine": first["engine"], "settings": first.get("settings"),
        "clients": first.get("clients"), "num_runs": len(rs), "num_requests": first["num_requests"],
        "req_per_s": statistics.median(req), "req_per_s_min": min(req), "req_per_s_max": max(req),
        "prompt_tokens": first["prompt_tokens"], "computed_tokens": statistics.median(computed),
        "computed_tokens_runs": computed, "hit_rate": statistics.median(r["hit_rate"] or 0.0 for r in rs),
        "optimal_hit_rate": first["optimal_hit_rate"],
        "optimal_computed_tokens": first.get("optimal_computed_tokens"),
    }
    for key in _TIMED:
        values = [r[key] for r in rs if r.get(key) is not None]
        row[key[:-2] + "_ms"] = 1000 * statistics.median(values) if values else None
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per workload with both engines: radixserve / llama.cpp of the median req/s, and of TTFT and TPOT p50."""
    cell = {(r["workload"], r["engine"]): r for r in rows}
    out: dict[str, dict[str, Any]] = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        ours, theirs = cell.get((w, OURS)), cell.get((w, LLAMA))
        if ours is None or theirs is None:
            continue
        out[w] = {"req_per_s": _ratio(ours["req_per_s"], theirs["req_per_s"]),
                  "ttft_p50": _ratio(ours["ttft_p50_ms"], theirs["ttft_p50_ms"]),
                  "tpot_p50": _ratio(ours["tpot_p50_ms"], theirs["tpot_p50_ms"]),
                  "llama_settings": theirs["settings"]}
    return out


def summarize_single(single: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per engine: median prefill and decode tokens/s (min–max); radixserve / llama.cpp of each median."""
    engines: dict[str, dict[str, Any]] = {}
    for engine in dict.fromkeys(r["engine"] for r in single):
        rs = [r for r in single if r["engine"] == engine]
        engines[engine] = {"num_runs": len(rs), "context": rs[0]["context"], "new_tokens": rs[0]["new_tokens"],
                           "batch": rs[0].get("batch", 1)}
        for key in ("prefill_tok_s", "decode_tok_s"):
            values = [r[key] for r in rs]
            engines[engine].update({key: statistics.median(values), key + "_min": min(values),
                                    key + "_max": max(values)})
    out: dict[str, Any] = {"engines": engines}
    if OURS in engines and LLAMA in engines:
        for key in ("prefill_tok_s", "decode_tok_s"):
            out[key.replace("_tok_s", "_ratio")] = _ratio(engines[OURS][key], engines[LLAMA][key])
    return out


def _sweep_row(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run.get(k) for k in ("workload", "settings", "req_per_s", "ttft_p50_s", "computed_tokens", "chosen")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def write_report(report: dict[str, Any], out: BenchOutput) -> str:
    """Writes peer_llamacpp_MODEL_DTYPE.{json,md} (MODEL: a checkpoint directory's name; `_single` after a run of
    the single stream only); returns the Markdown."""
    model = os.path.basename(str(report.get("model")).rstrip("/"))
    batch = next(iter((report.get("single_stream") or {}).get("engines", {}).values()), {}).get("batch", 1)
    single_only = ("_single" if batch == 1 else f"_batch{batch}") if not report.get("rows") else ""
    return out.write_report(f"peer_llamacpp_{model}_{report.get('dtype')}{single_only}", report, markdown(report))


_HEAD = ("| workload | engine | clients | llama.cpp slots | req/s median (min–max) | TTFT p50 / p99 ms "
         "| TPOT p50 / p99 ms | prompt tokens computed | hit rate | optimal |")


def markdown(r: dict[str, Any]) -> str:
    load = r.get("load_average") or {}
    lines = ["# radixserve vs llama.cpp's server (same checkpoint, token ids, client)", "",
             f"Command: `{r.get('command', '').strip()}` ({r.get('elapsed_s', 0) / 60:.1f} min). "
             f"Model {r.get('model')} in {r.get('dtype')}, {r.get('threads')} thread(s) per engine; machine "
             f"{r.get('machine')}; load average (1 min) {_fmt(load.get('start'), '.2f')} at the start, "
             f"{_fmt(load.get('end'), '.2f')} at the end.", "", *_method(r), "", _HEAD, "|---" * 10 + "|"]
    lines += [_table_line(row) for row in r["rows"]]
    lines.append("")
    for w, x in r.get("ratios", {}).items():
        lines.append(f"- {w}: radixserve / llama.cpp ({_slots(x['llama_settings'])}) = **{_fmt(x['req_per_s'])}x** "
                     f"req/s; TTFT p50 {_fmt(x['ttft_p50'])}x, TPOT p50 {_fmt(x['tpot_p50'])}x (lower is faster)")
    lines += _sweep_lines(r.get("sweep") or [])
    lines += _single_lines(r.get("single_stream") or {})
    lines += ["", "Engines:", ""] + [f"- {name}: `{info}`" for name, info in (r.get("engines") or {}).items()]
    return "\n".join(lines) + "\n"


def _method(r: dict[str, Any]) -> list[str]:
    return [(f"{r.get('size')} workloads, seed {r.get('seed')}; greedy, ignore_eos, token-id prompts over HTTP "
             "from the same client: radixserve POST /generate with input_ids, streamed; llama.cpp POST /completion "
             "with the ids as prompt and cache_prompt, not streamed (its stream drops the ids of tokens that end "
             "inside a UTF-8 sequence). Each workload runs first with each llama.cpp slot setting once (one fresh "
             "server each) and the best req/s is kept; then the engines alternate, reversed every other repetition, "
             f"median of {r.get('runs')} runs (min–max). Every run starts from an empty prefix cache (radixserve: "
             f"/flush_cache; llama.cpp: a fresh server) after {r.get('settle_s')} s idle. TTFT and TPOT per "
             "request: radixserve's at the client (TPOT = (last - first token) / (tokens - 1)); llama.cpp's TTFT = "
             "the client's latency - the server's first-to-last-token time (timings.predicted_ms), TPOT = that / "
             "(tokens - 1). req/s over the summed time of the workload's rounds. Prompt tokens computed: "
             "radixserve = prompt - meta_info.cached_tokens; llama.cpp = timings.prompt_n; hit rate = 1 - "
             "computed / prompt tokens; optimal = radix/optimal.py (page size 1, infinite cache). Absolute "
             "times on a shared machine are noise; compare the ratios.")]


def _table_line(row: dict[str, Any]) -> str:
    bold = "**" if row["engine"] == OURS else ""
    varies = "" if len(set(row["computed_tokens_runs"])) <= 1 else " (varies)"
    return (f"| {row['workload']} | {bold}{row['engine']}{bold} | {_fmt(row.get('clients'), 'd')} | "
            f"{_slots(row['settings']) if row['engine'] == LLAMA else '-'} | {row['req_per_s']:.2f} "
            f"({row['req_per_s_min']:.2f}–{row['req_per_s_max']:.2f}) | {_fmt(row['ttft_p50_ms'], '.0f')} / "
            f"{_fmt(row['ttft_p99_ms'], '.0f')} | {_fmt(row['tpot_p50_ms'], '.1f')} / "
            f"{_fmt(row['tpot_p99_ms'], '.1f')} | {row['computed_tokens']:.0f} of {row['prompt_tokens']}{varies} | "
            f"{row['hit_rate']:.3f} | {row['optimal_hit_rate']:.3f} |")


def _sweep_lines(sweep: list[dict[str, Any]]) -> list[str]:
    if not sweep:
        return []
    lines = ["", "llama.cpp slot settings tried (one run each, fresh server; the best req/s was measured):", "",
             "| workload | slots | req/s | TTFT p50 ms | prompt tokens computed | kept |", "|---|---|---|---|---|---|"]
    for s in sweep:
        lines.append(f"| {s['workload']} | {_slots(s['settings'])} | {s['req_per_s']:.2f} | "
                     f"{_fmt(1000 * s['ttft_p50_s'] if s.get('ttft_p50_s') is not None else None, '.0f')} | "
                     f"{s['computed_tokens']} | {'yes' if s.get('chosen') else ''} |")
    return lines


def _single_lines(single: dict[str, Any]) -> list[str]:
    engines = single.get("engines") or {}
    if not engines:
        return []
    first = next(iter(engines.values()))
    batch = first.get("batch", 1)
    what = "Single stream (batch 1" if batch == 1 else f"Batch decode ({batch} sequences together, tokens/s of all"
    lines = ["", f"{what}, {first['context']}-token prompts of random ids, {first['new_tokens']} new "
             "tokens; median (min–max); llama.cpp: llama-batched-bench, radixserve: Engine in-process, alternating):",
             "", "| engine | prefill tok/s | decode tok/s | runs |", "|---|---|---|---|"]
    for name, e in engines.items():
        rates = [f"{e[k]:.1f} ({e[k + '_min']:.1f}–{e[k + '_max']:.1f})" for k in ("prefill_tok_s", "decode_tok_s")]
        lines.append(f"| {name} | {rates[0]} | {rates[1]} | {e['num_runs']} |")
    if "decode_ratio" in single:
        lines += ["", f"- radixserve / llama.cpp: decode **{_fmt(single['decode_ratio'])}x**, prefill "
                      f"**{_fmt(single['prefill_ratio'])}x** (tokens/s)"]
    return lines


def _slots(settings: str | None) -> str:
    """'16' -> '16 slots, KV per slot'; '16u' -> '16 slots, unified KV'."""
    if not settings:
        return "-"
    unified = settings.endswith("u")
    return f"{settings.rstrip('u')} slots, {'unified KV' if unified else 'KV per slot'}"


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
