"""The highest fraction of the matmul roofline that any engine could reach on each peer workload (in the model's
dtype, fp32 or bf16, on this machine), beside the fractions a peer_vllm run reached.

The peer bench reports linear GFLOP/s = linear FLOPs / wall time as a fraction of the measured matmul roofline
(bench/roofline.py). Two things that every engine must also do bound that fraction below 1:

- attention: 4 * heads * head_dim * layers FLOPs per (query, key) pair of every computed position, counted here
  at the matmul roofline itself (optimistic: torch's flash attention for CPU measured 110-220 GFLOP/s on
  2 threads on the machines used so far, against rooflines of 300-430);
- decode steps: a step of b sequences reads every linear weight and the LM head once, so it takes at least
  max(weight bytes / streaming bandwidth, 2 * (P_linear + P_head) * b / roofline). The bandwidth is measured by
  summing an fp32 tensor the size of the linear weights (meaningful when they do not fit in the caches: models
  M and L, not S).

Everything else (norms, rotary, sampling, host work, KV reads) is taken as free, so the result is an upper
bound: best time = prefill linears + decode steps + attention, and the ceiling = (linear FLOPs / roofline) / best
time. Computed positions are those of the §12 optimum (radix/optimal.py), with each round's requests batched
max_running at a time.

    python -m radixserve.bench.ceiling --model M    # -> roofline_ceiling_M.{json,md}
    python -m radixserve.bench.ceiling --model L    # bf16, issue 35's workload shapes -> roofline_ceiling_L_bf16
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from . import roofline
from ..radix.optimal import Computed, computed_spans
from .output import BenchOutput, bench_parser, parse_args, progress

# The peer run whose roofline fractions the table shows by default: the one the README quotes.
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass(frozen=True)
class Ceiling:
    linear_tflop: float
    attention_tflop: float
    decode_steps: int
    prefill_s: float  # linear FLOPs of computed prompt positions at the roofline
    decode_s: float  # the decode steps' linears, each at least one read of the weights
    attention_s: float
    linear_roof_s: float  # every linear FLOP (prompt and output positions) at the roofline

    @property
    def best_s(self) -> float:
        return self.prefill_s + self.decode_s + self.attention_s

    @property
    def max_fraction(self) -> float:
        return self.linear_roof_s / self.best_s if self.best_s else 0.0


def _pairs(first: int, end: int) -> int:
    """(query, key) pairs of causal positions [first, end): position p sees p + 1 keys."""
    return (end * (end + 1) - first * (first + 1)) // 2


def _decode_batches(round_spans: Sequence[Computed], max_running: int) -> list[int]:
    """Sequences per decode step: a round's requests max_running at a time, each for output_len steps."""
    sizes = []
    for at in range(0, len(round_spans), max_running):
        outs = [c.output_len for c in round_spans[at:at + max_running]]
        sizes += [sum(n > step for n in outs) for step in range(max(outs, default=0))]
    return sizes


def ceiling(config: dict[str, Any], rounds: Sequence[Sequence[tuple]], gflops: float, stream_gbs: float,
            max_running: int = 64, dtype_bytes: int = 4) -> Ceiling:
    params, head = roofline.linear_params(config), config["vocab_size"] * config["hidden_size"]
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = roofline.head_dim(config)
    roof, weight_s = gflops * 1e9, dtype_bytes * (params + head) / (stream_gbs * 1e9)
    spans = computed_spans(rounds)
    flat = [c for round_spans in spans for c in round_spans]
    prompt_tokens = sum(c.prompt_len - c.start for c in flat)
    output_tokens = sum(c.output_len for c in flat)
    attention = 4.0 * heads * head_dim * layers * sum(_pairs(c.start, c.prompt_len + c.output_len) for c in flat)
    batches = [b for round_spans in spans for b in _decode_batches(round_spans, max_running)]
    linear = roofline.linear_flops(config, prompt_tokens + output_tokens)
    return Ceiling(linear_tflop=linear / 1e12, attention_tflop=attention / 1e12, decode_steps=len(batches),
                   prefill_s=2.0 * params * prompt_tokens / roof,
                   decode_s=sum(max(weight_s, 2.0 * (params + head) * b / roof) for b in batches),
                   attention_s=attention / roof, linear_roof_s=linear / roof)


def build_report(config: dict[str, Any], workloads: dict[str, Sequence[Sequence[tuple]]], gflops: float,
                 stream_gbs: float, measured: dict[str, dict[str, float]] | None = None,
                 dtype: str = "float32") -> dict[str, Any]:
    """measured: workload -> engine -> roofline fraction reached (from a peer_vllm report), if any."""
    rows = []
    for name, rounds in workloads.items():
        c = ceiling(config, rounds, gflops, stream_gbs, dtype_bytes=roofline.DTYPE_BYTES[dtype])
        rows.append({"workload": name, **asdict(c), "best_s": c.best_s, "max_fraction": c.max_fraction,
                     "measured": (measured or {}).get(name, {})})
    return {"bench": "roofline_ceiling", "dtype": dtype, "gflops": gflops, "stream_gbs": stream_gbs, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    engines = sorted({e for row in report["rows"] for e in row["measured"]})
    head = "| workload | linear TFLOP | attention TFLOP | decode steps | best time (prefill + decode + attention) " \
           "| ceiling |" + "".join(f" {e} reached |" for e in engines)
    method = (__doc__ or "").split("\n\n")[:4]  # the docstring without its command line
    lines = ["# The roofline fraction's ceiling", "", *"\n\n".join(method).split("\n"), "",
             f"{report.get('dtype', 'float32')} matmul roofline **{report['gflops']:.1f} GFLOP/s** ({report.get('gflops_source', 'given')}), "
             f"weight streaming **{report['stream_gbs']:.1f} GB/s** (measured in this run). \"reached\": the "
             f"fraction that engine reached in the peer run {report.get('peer_report') or '(none given)'}.", "",
             head, "|---" * (6 + len(engines)) + "|"]
    for row in report["rows"]:
        best = (f"{row['best_s']:.2f} s ({row['prefill_s']:.2f} + {row['decode_s']:.2f} + "
                f"{row['attention_s']:.2f})")
        reached = "".join(f" {row['measured'][e]:.0%} |" if e in row["measured"] else " – |" for e in engines)
        lines.append(f"| {row['workload']} | {row['linear_tflop']:.2f} | {row['attention_tflop']:.2f} | "
                     f"{row['decode_steps']} | {best} | **{row['max_fraction']:.0%}** |{reached}")
    return "\n".join(lines) + "\n"


def measured_fractions(peer_report: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for row in peer_report.get("rows", []):
        if row.get("roofline_fraction") is not None:
            out.setdefault(row["workload"], {})[row["engine"]] = row["roofline_fraction"]
    return out


def _peer_report(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    return report if report.get("roofline") else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from .harness import MODEL_HELP, bench_model_path, stand_in_rounds
    from .peer_sides import resolve_dtype
    from .peer_vllm import PEER_WORKLOADS
    from .report_peer import report_name
    from .workloads import SIZES, make_workload

    p = bench_parser("ceiling", __doc__)
    p.add_argument("--model", default="M", help=MODEL_HELP)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the weights' dtype (auto: the checkpoint's own, bf16 for L)")
    p.add_argument("--size", choices=SIZES, help="workload size (default: real for L, full otherwise)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the roofline and bandwidth measurements")
    p.add_argument("--peer-report", metavar="JSON",
                   help="a peer_vllm report whose roofline and reached fractions to show (default: the README's, "
                        "bench/results/peer_vllm_MODEL[_bf16].json, where it exists); without one the roofline is "
                        "measured")
    args = parse_args(p, argv)
    config = roofline.load_config(bench_model_path(args.model))
    dtype, size = resolve_dtype(args.dtype, config), args.size or ("real" if args.model == "L" else "full")
    peer_name = report_name({"model": args.model, "dtype": dtype})
    peer_path = args.peer_report or os.path.join(RESULTS_DIR, f"{peer_name}.json")
    peer = _peer_report(peer_path)
    if args.peer_report and peer is None:
        p.error(f"--peer-report {args.peer_report}: no such file, or a report without a roofline")
    with progress(2 + len(PEER_WORKLOADS), "ceiling", unit="step") as bar:
        # The fractions a peer run reached are over its own roofline: the ceiling uses the same one.
        gflops = ((peer or {}).get("roofline", {}).get("gflops")
                  or roofline.measure_roofline(config, args.threads, dtype=dtype)["gflops"])
        bar.update()
        stream = roofline.measure_stream_gbs(roofline.linear_params(config), args.threads)
        bar.update()
        workloads = {}
        for name in PEER_WORKLOADS:
            workloads[name] = stand_in_rounds(lambda name=name: make_workload(name, size, 0))
            bar.update()
    report = build_report(config, workloads, gflops, stream, measured_fractions(peer) if peer else None, dtype)
    report["gflops_source"] = "the peer report's roofline" if peer else "measured in this run"
    shown = args.peer_report or f"bench/results/{peer_name}.json"  # not this machine's absolute path
    report.update(model=args.model, size=size, threads=args.threads, peer_report=shown if peer else None)
    out = BenchOutput("ceiling", args.out)
    out.finish(out.write_report(peer_name.replace("peer_vllm", "roofline_ceiling"), report, markdown(report)))
    return report


if __name__ == "__main__":
    main()
