"""peer_serve's report: run records -> rows (medians, ratios to the best vLLM server), Markdown
and a PNG (bench/peer_serve.py measures; this module only aggregates and writes)."""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from typing import Any

from .output import BenchOutput
from .report_peer import OURS

# Medians over the runs of these (plus the hit rate) make a row.
ROW_KEYS = ("request_throughput", "output_throughput", "total_token_throughput", "duration", "p50_ttft_ms",
            "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms",
            "hit_rate")

def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run records -> one row per (concurrency, server): medians over the repetitions, min/max req/s,
    and each row's req/s / the best vLLM's at that concurrency (ratio, vs_best_vllm)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["concurrency"], r["server"]), []).append(r)
    rows = []
    for (c, name), mine in groups.items():
        mine = sorted(mine, key=lambda r: r["rep"])
        row: dict[str, Any] = {"concurrency": c, "server": name, "num_runs": len(mine),
                               "completed": sum(r["completed"] or 0 for r in mine),
                               "failed": sum(r["failed"] or 0 for r in mine),
                               "total_input_tokens": mine[0]["total_input_tokens"],
                               "total_output_tokens": mine[0]["total_output_tokens"]}
        for key in ROW_KEYS:
            values = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        req = [r["request_throughput"] for r in mine if r.get("request_throughput") is not None]
        row["req_per_s_runs"] = req
        row["req_per_s_min"] = min(req) if req else None
        row["req_per_s_max"] = max(req) if req else None
        rows.append(row)
    best = ratios(rows)
    for row in rows:
        ref = best.get(row["concurrency"])
        row["vs_best_vllm"] = row["request_throughput"] / ref["best_vllm_req_per_s"] if ref else None
    return rows


def ratios(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per concurrency: the vLLM server with the best median req/s, and radixserve / it (req/s and TPOT)."""
    out: dict[int, dict[str, Any]] = {}
    for c in sorted({r["concurrency"] for r in rows}):
        peers = [r for r in rows if r["concurrency"] == c and r["server"] != OURS and r["request_throughput"]]
        ours = next((r for r in rows if r["concurrency"] == c and r["server"] == OURS), None)
        if not peers:
            continue
        best = max(peers, key=lambda r: r["request_throughput"])
        out[c] = {"best_vllm": best["server"], "best_vllm_req_per_s": best["request_throughput"],
                  "ours_req_per_s": ours["request_throughput"] if ours else None,
                  "ours_over_best": (ours["request_throughput"] / best["request_throughput"]
                                     if ours and ours["request_throughput"] is not None else None),
                  "tpot_p50_ours_over_best": (ours["p50_tpot_ms"] / best["p50_tpot_ms"]
                                              if ours and ours["p50_tpot_ms"] and best["p50_tpot_ms"] else None)}
    return out


def build_report(runs: Sequence[dict[str, Any]], meta: dict[str, Any], servers: dict[str, Any]) -> dict[str, Any]:
    rows = summarize(runs)
    return {"bench": "peer_serve", **meta, "servers": servers, "rows": rows,
            "ratios": {str(c): x for c, x in ratios(rows).items()}, "records": list(runs)}


_HEAD = ("| c | server | req/s median (min–max) | output tok/s | total tok/s | TTFT p50 / p99 (ms) "
         "| TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | hit rate | failed | vs best vLLM |")


def markdown(r: dict[str, Any]) -> str:
    w = r["workload"]
    lines = [
        f"# radixserve vs vLLM's OpenAI server, measured by `vllm bench serve` (model {r.get('model')})", "",
        (f"Command: `{r.get('command', '').strip()}` ({r.get('elapsed_s', 0) / 60:.1f} min). "
         f"Machine {r.get('machine')}, {r.get('threads')} thread(s) per server."), "",
        (f"Client: vLLM {r.get('vllm_version')} `vllm bench serve --backend openai --endpoint /v1/completions "
         f"--dataset-name prefix_repetition` with {w['num_prefixes']} prefixes x {w['prefix_len']} tokens, "
         f"suffix {w['suffix_len']} tokens, {w['output_len']} output tokens (--ignore-eos, --temperature 0), "
         f"{r.get('num_prompts')} prompts per run, --request-rate inf, --max-concurrency c, seed {r.get('seed')} "
         "(the same prompts every run); it runs on the same cores as the server it measures. Servers (below) start "
         "once and are warmed up; per concurrency the runs alternate the servers' order, reversed every other "
         f"repetition, each from an emptied prefix cache after {r.get('settle_s', 0):g} s idle; median of "
         f"{r.get('runs')} runs (min–max). TTFT / TPOT / ITL are vLLM's (p50 / p99 per run, median over runs); "
         "tok/s as vLLM counts them (total = input + output tokens, cached included). Hit rate = cached / prompt "
         "tokens as the server counted them over the run (radixserve: /get_server_info stats, page size 1; "
         "vLLM: /metrics prefix_cache_hits / queries, whole blocks only). vs best vLLM = median req/s / that "
         "of the faster vLLM block size at the same c. Absolute times on a shared machine are noise; compare "
         "the ratios."), "",
        _HEAD, "|" + "---|" * 11,
    ]
    for row in r["rows"]:
        bold = "**" if row["server"] == OURS else ""
        vs = "-" if row.get("vs_best_vllm") is None else f"{row['vs_best_vllm']:.2f}x"
        lines.append(
            f"| {row['concurrency']} | {bold}{row['server']}{bold} | {_f(row['request_throughput'])} "
            f"({_f(row['req_per_s_min'])}–{_f(row['req_per_s_max'])}) | {_f(row['output_throughput'], 0)} "
            f"| {_f(row['total_token_throughput'], 0)} | {_f(row['p50_ttft_ms'], 1)} / {_f(row['p99_ttft_ms'], 1)} "
            f"| {_f(row['p50_tpot_ms'], 1)} / {_f(row['p99_tpot_ms'], 1)} "
            f"| {_f(row['p50_itl_ms'], 1)} / {_f(row['p99_itl_ms'], 1)} | {_f(row['hit_rate'], 3)} "
            f"| {row['failed']} | {vs} |")
    lines.append("")
    for c, x in r.get("ratios", {}).items():
        if x["ours_over_best"] is not None:
            tpot = x.get("tpot_p50_ours_over_best")
            lines.append(f"- c={c}: radixserve / best vLLM ({x['best_vllm']}) = **{x['ours_over_best']:.2f}x** req/s"
                         + ("" if tpot is None else f"; TPOT p50 ratio {tpot:.2f}"))
    inputs = {row["total_input_tokens"] for row in r["rows"]}
    if len(inputs) > 1:
        lines += ["", f"Note: the servers counted different prompt token totals per run: {sorted(inputs)}."]
    lines += ["", "Servers:", ""]
    for name, info in r.get("servers", {}).items():
        env = " ".join(f"{k}={v}" for k, v in (info.get("env") or {}).items())
        lines.append(f"- {name}: `{(env + ' ') if env else ''}{_short(info.get('command', ''))}`"
                     + (f", started in {info['startup_s']:.0f} s" if info.get("startup_s") else ""))
    lines += ["", f"![req/s and TPOT]({r.get('stem', 'peer_serve')}.png)", ""]
    return "\n".join(lines)


def _short(command: str) -> str:
    """The command with the checkpoint's cache path shortened to its folder name."""
    return " ".join(os.path.basename(p) if p.startswith("/") and os.sep + "ckpt-" in p else p for p in command.split())


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def plot(r: dict[str, Any], path: str) -> None:
    """Top: median req/s / the best vLLM's per concurrency (bars: min–max). Bottom: TPOT p50 (bar)
    and p99 (tick) per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = r["rows"]
    levels = sorted({row["concurrency"] for row in rows})
    names = list(dict.fromkeys(row["server"] for row in rows))
    cell = {(row["concurrency"], row["server"]): row for row in rows}
    width = 0.8 / max(1, len(names))
    fig, (ax_r, ax_t) = plt.subplots(2, 1, figsize=(max(6.0, 2.0 * len(levels)), 6.0))
    for num, name in enumerate(names):
        xs, rel, err, tpot50, tpot99 = [], [], [[], []], [], []
        for i, c in enumerate(levels):
            row = cell.get((c, name))
            if row is None or not row["request_throughput"]:
                continue
            ref = r["ratios"].get(str(c))
            base = ref["best_vllm_req_per_s"] if ref else row["request_throughput"]
            xs.append(i + (num - (len(names) - 1) / 2) * width)
            rel.append(row["request_throughput"] / base)
            err[0].append((row["request_throughput"] - row["req_per_s_min"]) / base)
            err[1].append((row["req_per_s_max"] - row["request_throughput"]) / base)
            tpot50.append(row["p50_tpot_ms"] or 0.0)
            tpot99.append(row["p99_tpot_ms"] or 0.0)
        ax_r.bar(xs, rel, width, yerr=err, capsize=2, label=name)
        ax_t.bar(xs, tpot50, width, label=name)
        ax_t.plot(xs, tpot99, "k_", markersize=12)
    ax_r.axhline(1.0, color="black", linewidth=0.8)
    ax_r.set_ylabel("req/s / best vLLM")
    ax_t.set_ylabel("TPOT p50 (bar), p99 (tick), ms")
    for ax in (ax_r, ax_t):
        ax.set_xticks(range(len(levels)))
        ax.set_xticklabels([f"c={c}" for c in levels])
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"model {r.get('model')}: vllm bench serve, prefix_repetition")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict[str, Any], out: BenchOutput) -> str:
    """Writes peer_serve_MODEL.{json,png,md}; returns the Markdown."""
    stem = report.setdefault("stem", f"peer_serve_{report.get('model')}")
    return out.write_report(stem, report, markdown(report), lambda path: plot(report, path))


