"""Decode steps against the weight-streaming floor: how close a decode step's linears and LM head come to reading
their weights once at the machine's read bandwidth, and what the linears reach at each row count.

Three measurements in one process (torch threads as --threads):

- the read bandwidth: torch.sum over an fp32 buffer of --stream-gib (at least 4x the last-level cache, so it
  comes from memory; bench/roofline.py's measure_stream_gbs);
- the model's layer shapes in its dtype at each of --rows: the engine's Linear (the tile kernel where it
  applies: AMX, or vdpbf16ps over the same layout; and oneDNN's packed weights) and torch.matmul on the plain
  weight, GFLOP/s and weight GB/s (median of --repeats, the methods alternating; up to 64 rows over distinct
  copies of the layer past the LLC);
- the engine in-process at each of --batches: requests of --context random prompt tokens decode --new-tokens;
  the median decode step, the time inside the model's linears and LM head (timed around each call), and the
  floor = weight bytes read per step / bandwidth (KV bytes beside it). The host's bandwidth moves with its
  neighbours (41-77 GB/s within a day here), so the decode timings run in --rounds, each between two bandwidth
  measurements, and each round's ratio is taken against the bandwidth measured around it; medians over rounds.
  Beside it the compute floor: the step's multiply-adds at the highest rate the tile kernel reached (its largest
  row count); where that is above the weight floor (many rows, or a fast memory), no kernel can reach the weight
  floor, and max(weights, compute) is the floor a perfect overlap of the two would reach.

    python -m radixserve.bench.decode_floor --model L
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any, Sequence

from . import roofline
from .output import BenchOutput, bench_parser, parse_args, progress

def weight_bytes(config: dict[str, Any], elem: int) -> int:
    """Bytes of the linears and the LM head that one decode step reads (the embedding's few rows are left out)."""
    return elem * (roofline.linear_params(config) + config["vocab_size"] * config["hidden_size"])


STREAM_BYTES = 2**30  # the distinct weights a timing at few rows cycles through: more than the LLC holds
FEW_ROWS = 64  # up to here a linear streams its weights; beyond, it is compute-bound and one copy is timed


def _methods(weight: Any) -> dict[str, Any]:
    """The ways the engine can run a weight: the tile kernel (AMX or vdpbf16ps) where it applies, oneDNN's packed
    layout."""
    from ..kernels.layers import Linear

    tiled = Linear(weight, None)
    out = {"tiles": tiled} if tiled.tiles is not None else {}
    return out | {"oneDNN packed": Linear(weight, None, tiles=False)}


MAX_COPIES = 64  # a small layer's copies past this would only cost time: it is cache-resident anyway


def _copies(weight_bytes: int, m: int) -> int:
    return min(MAX_COPIES, max(1, -(-STREAM_BYTES // weight_bytes))) if m <= FEW_ROWS else 1


def linear_rates(config: dict[str, Any], dtype: str, rows: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Per row count: the layer's linears as the engine can run them and as torch.matmul, alternating; at few
    rows over distinct copies of the layer that together exceed the last-level cache, so the weights come from
    memory as they do in a decode step (one layer timed alone stays in a large L3)."""
    import torch

    tdtype = getattr(torch, dtype)
    shapes = roofline.layer_shapes(config)
    layer_bytes = sum(k * n for k, n in shapes) * roofline.DTYPE_BYTES[dtype]
    out: list[dict[str, Any]] = []
    for m in rows:
        layers = [[torch.randn(n, k).to(tdtype) for k, n in shapes] for _ in range(_copies(layer_bytes, m))]
        runs = [[_methods(w) for w in layer] for layer in layers]

        def kinds(xs, layers=layers, runs=runs):
            out = {name: (lambda name=name: [r[name](x) for layer in runs for r, x in zip(layer, xs)])
                   for name in runs[0][0]}
            return out | {"matmul": lambda: [torch.matmul(x, w.t()) for layer in layers for x, w in zip(xs, layer)]}

        out += _rates(shapes, dtype, [m], repeats, kinds, copies=len(layers))
    return out


def head_rates(config: dict[str, Any], dtype: str, rows: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Per row count: the LM head (vocab x hidden) from a packed copy (tiles where they apply, and oneDNN) and
    from the plain table a tied head shares with the embedding (the native kernel at its few rows, F.linear
    beyond), alternating."""
    import torch

    from ..kernels.layers import Linear

    shape = (config["hidden_size"], config["vocab_size"])
    table = torch.randn(shape[1], shape[0]).to(getattr(torch, dtype))
    runs = _methods(table) | {"shared table": Linear(table, None, pack=False)}
    return _rates([shape], dtype, rows, repeats, lambda xs: {
        name: (lambda run=run: run(xs[0])) for name, run in runs.items()})


def _rates(shapes: list[tuple[int, int]], dtype: str, rows: Sequence[int], repeats: int,
           kinds_for: Any, copies: int = 1) -> list[dict[str, Any]]:
    """Median time of each kind (kinds_for(inputs) -> name: run) at each row count, the kinds alternating;
    a run covers `copies` copies of the shapes (the figures are per copy)."""
    import torch

    out = []
    for m in rows:
        kinds = kinds_for([torch.randn(m, k).to(getattr(torch, dtype)) for k, _ in shapes])
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for kind in kinds.values():
            kind()  # first call: oneDNN builds its primitive for this shape
        for _ in range(repeats):
            for name, run in kinds.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        flops = sum(2.0 * m * k * n for k, n in shapes)
        wbytes = sum(k * n for k, n in shapes) * roofline.DTYPE_BYTES[dtype]
        for name, ts in times.items():
            med = statistics.median(ts) / copies
            out.append({"rows": m, "method": name, "ms": med * 1e3, "gflops": flops / med / 1e9,
                        "weight_gbs": wbytes / med / 1e9})
    return out


def decode_steps(model_path: str, dtype: str, batch: int, context: int, new_tokens: int) -> dict[str, Any]:
    """The engine decoding `batch` requests after a `context`-token prompt each: median step and linear time."""
    from ..kernels import layers
    from ..scheduler import Engine, SamplingParams

    engine = Engine(model_path, dtype=dtype, kv_cache_tokens=batch * (context + new_tokens) + 256)
    vocab = engine.model_config.vocab_size
    rng = random.Random(batch)
    for _ in range(batch):
        engine.add_request([rng.randrange(10, vocab) for _ in range(context)],
                           SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True))
    spent = [0.0]
    real_call = layers.Linear.__call__

    def timed(self, x):
        start = time.perf_counter()
        try:
            return real_call(self, x)
        finally:
            spent[0] += time.perf_counter() - start

    steps, linear = [], []
    layers.Linear.__call__ = timed
    try:
        while engine.has_unfinished():
            spent[0], start = 0.0, time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
            linear.append(spent[0])
    finally:
        layers.Linear.__call__ = real_call
    keep = slice(len(steps) - (new_tokens - 2), None)  # decode steps only, the first one left out
    return {"batch": batch, "step_ms": statistics.median(steps[keep]) * 1e3,
            "linear_ms": statistics.median(linear[keep]) * 1e3, "decode_steps": len(steps[keep])}


def peak_gflops(rates: list[dict[str, Any]]) -> float | None:
    """The best rate the tile kernel (else any method) reached: the compute floor's rate."""
    tiles = [r["gflops"] for r in rates if r["method"] == "tiles"]
    return max(tiles or [r["gflops"] for r in rates] or [0.0]) or None


def summarize(config: dict[str, Any], result: dict[str, Any], runs: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """One batch's rounds (each run with the bandwidth measured around it): medians of the times, of the floors and
    of each round's ratios."""
    batch = runs[0][0]["batch"]
    flops = 2 * batch * (roofline.linear_params(config) + config["vocab_size"] * config["hidden_size"])
    peak = result.get("peak_gflops")
    compute = flops / peak / 1e6 if peak else 0.0
    kv = batch * result["context"] * result["kv_bytes_per_token"]
    floors = [result["weight_bytes"] / bw / 1e6 for _, bw in runs]
    med = statistics.median
    return {"batch": batch, "step_ms": med(r["step_ms"] for r, _ in runs),
            "linear_ms": med(r["linear_ms"] for r, _ in runs), "floor_ms": med(floors),
            "compute_floor_ms": compute, "vs_floor": med(r["linear_ms"] / f for (r, _), f in zip(runs, floors)),
            "vs_max_floor": med(r["linear_ms"] / max(f, compute) for (r, _), f in zip(runs, floors)),
            "step_vs_floor": med(r["step_ms"] / ((result["weight_bytes"] + kv) / bw / 1e6) for r, bw in runs),
            "rounds": [{**r, "stream_gbs": bw} for r, bw in runs]}


def report(result: dict[str, Any]) -> tuple[str, str]:
    """(markdown, table) of a result."""
    bws = result["stream_gbs_rounds"]
    peak = result.get("peak_gflops")
    lines = [f"# Decode steps against the weight-streaming floor: {result['model']} ({result['dtype']})", "",
             f"`{result['command']}`", "",
             f"Read bandwidth {statistics.median(bws):.1f} GB/s, median of {len(bws)} measurements around the "
             f"rounds ({min(bws):.1f}-{max(bws):.1f}; torch.sum over {result['stream_gib']} GiB fp32, "
             f"{result['threads']} threads); weights read per decode step {result['weight_bytes'] / 1e6:.0f} MB "
             f"(linears and LM head); KV {result['kv_bytes_per_token'] / 1e3:.1f} KB per token; compute floor at "
             f"{peak or 0:.0f} GFLOP/s (the tile kernel's best rate below). Each ratio is the median over "
             f"{result['rounds']} rounds of the round's time over its floor at the bandwidth measured around it.", ""]
    table = ["| batch | step ms | linears + head ms | weight floor ms | compute floor ms | linears / weight floor | "
             "linears / max(weight, compute) | KV read MB | step / (weights + KV) floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["decode"]:
        kv = row["batch"] * result["context"] * result["kv_bytes_per_token"]
        table.append(f"| {row['batch']} | {row['step_ms']:.1f} | {row['linear_ms']:.1f} | {row['floor_ms']:.1f} | "
                     f"{row['compute_floor_ms']:.1f} | {row['vs_floor']:.2f}x | {row['vs_max_floor']:.2f}x | "
                     f"{kv / 1e6:.0f} | {row['step_vs_floor']:.2f}x |")
    rates = ["| rows | method | ms per layer | GFLOP/s | weight GB/s |", "|---|---|---|---|---|"]
    rates += [f"| {r['rows']} | {r['method']} | {r['ms']:.3f} | {r['gflops']:.0f} | {r['weight_gbs']:.1f} |"
              for r in result["linear_rates"]]
    head = ["| rows | head from | ms | weight GB/s |", "|---|---|---|---|"]
    head += [f"| {r['rows']} | {r['method']} | {r['ms']:.2f} | {r['weight_gbs']:.1f} |"
             for r in result.get("head_rates", [])]
    text = "\n".join(table)
    parts = lines + table + ["", "One layer's linears at each row count (up to 64 rows: distinct copies, %.0f MB in all, so the weights come "
              "from memory):" % (STREAM_BYTES / 1e6), ""] + rates
    if result.get("head_rates"):
        parts += ["", "The LM head (vocab x hidden) from a packed copy or from the plain table a tied head shares "
                  "with the embedding (one copy):", ""] + head
    return "\n".join(parts) + "\n", text


def main(argv: Sequence[str] | None = None) -> None:
    parser = bench_parser("decode_floor", __doc__)
    parser.add_argument("--model", default="L", help="bench model (S, M, L), a checkpoint directory or a config.json")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's dtype), float32 or bfloat16")
    parser.add_argument("--batches", default="1,16", help="decode batch sizes to time, comma-separated")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens of each request")
    parser.add_argument("--new-tokens", type=int, default=34, help="tokens each request decodes")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,512,4096", help="row counts of the linear rates")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of each linear timing")
    parser.add_argument("--stream-gib", type=float, default=2.0, help="size of the bandwidth-test buffer (GiB)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="decode timings per batch, each between two bandwidth "
                        "measurements; medians reported")
    args = parse_args(parser, argv)

    import torch

    from .harness import bench_model_path

    torch.set_num_threads(args.threads)
    path = bench_model_path(args.model)
    config = roofline.load_config(path)
    dtype = (config.get("torch_dtype") or config.get("dtype") or "float32") if args.dtype == "auto" else args.dtype
    elem = roofline.DTYPE_BYTES[dtype]
    batches, rows = [int(b) for b in args.batches.split(",")], [int(r) for r in args.rows.split(",")]
    result: dict[str, Any] = {"command": args.command, "model": args.model, "dtype": dtype, "threads": args.threads,
                              "context": args.context, "stream_gib": args.stream_gib,
                              "weight_bytes": weight_bytes(config, elem),
                              "kv_bytes_per_token": roofline.kv_bytes_per_token(config, elem)}
    def stream() -> float:
        return roofline.measure_stream_gbs(int(args.stream_gib * 2**30 / 4), args.threads)

    with progress(2 + args.rounds * len(batches), "decode floor", unit="part") as bar:
        result["linear_rates"] = linear_rates(config, dtype, rows, args.repeats)
        bar.update()
        result["head_rates"] = head_rates(config, dtype, [r for r in rows if r <= 64], args.repeats)
        bar.update()
        bws, rounds = [stream()], []
        for _ in range(args.rounds):
            runs = []
            for batch in batches:
                runs.append(decode_steps(path, dtype, batch, args.context, args.new_tokens))
                bar.update()
            bws.append(stream())
            rounds.append((runs, (bws[-2] + bws[-1]) / 2))
    result |= {"rounds": args.rounds, "stream_gbs_rounds": bws, "stream_gbs": statistics.median(bws),
               "peak_gflops": peak_gflops(result["linear_rates"])}
    result["decode"] = [summarize(config, result, [(runs[i], bw) for runs, bw in rounds]) for i in range(len(batches))]
    markdown, table = report(result)
    out = BenchOutput("decode_floor", args.out)
    out.write_report(f"decode_floor_{args.model}", result, markdown)
    out.finish(table)


if __name__ == "__main__":
    main()
