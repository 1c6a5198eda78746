"""A large GGUF file on a small machine: peak RSS of loading and serving it against its size + the KV pool, and
single-stream decode tokens/s at a 1,024-token context beside llama.cpp's on the very same file and beside the
weight-streaming floor (issue 39: the 8B shape in Q4_0 loads with peak RSS <= 1.3x (file + KV pool) and serves).

    python -m radixserve.bench.gguf_memory --out bench/results     # the Llama-3.1-8B shape in Q4_0 (written once)
    python -m radixserve.bench.gguf_memory --shape tiny --gguf /tmp/tiny-q4_0.gguf --context 64 --runs 1   # smoke

The file is --gguf; where it is missing it is written there first in --shape as Q4_0 with seeded random weights
(bench/checkpoints/gguf_random.py, tensor by tensor; ~5 min and ~4.7 GB for the 8B shape). radixserve runs in a
child process (`Engine(FILE, dtype=bfloat16, kv_cache_tokens=K, context_length=K)`): its peak RSS is the child's
VmHWM (/proc/self/status: every page it ever had resident, the file's mapped pages included) after loading and again
after serving. Single stream: one request of --context random ids on an empty cache, --new-tokens decoded
(bench/_llamacpp.py's single_ours); llama.cpp: `llama-bench -p 0 -n NEW -d CONTEXT -r 1` on the same file (--llama-bench;
its decode after CONTEXT tokens in the KV cache; skipped when absent: llama-batched-bench's result line goes through
llama.cpp's asynchronous logger and is lost in most runs of this build); the engines alternate, --runs each, after
one untimed run of each radixserve child at the timed shapes (llama-bench makes its own warm-up run). The floor: the
bytes one decode step reads (packed linears and LM head; llama.cpp's: the file's tensors less the embedding table)
over the read bandwidth (roofline.measure_stream_gbs, measured after the engines have exited).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

from .output import BenchOutput, bench_parser, parse_args

LLAMA_BENCH = "/tmp/peers/llama.cpp/build/bin/llama-bench"
DEFAULT_GGUF = "/tmp/peers/gguf/llama8b-q4_0.gguf"
TARGET = 1.3  # peak RSS over (file + KV pool)


def vm_status() -> dict[str, int]:
    """VmHWM and VmRSS of this process, in bytes."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def model_bytes(model: Any) -> dict[str, int]:
    """Bytes the engine holds for the weights, and those one decode step streams (linears and LM head)."""
    import torch

    def size(x: Any) -> int:
        if x is None:
            return 0
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if hasattr(x, "nbytes"):  # quant.PackedQuant
            return x.nbytes
        return sum(size(t) for t in (x.quant, x.tiles, x.packed, x.weight, x.bias) if t is not None) \
            if hasattr(x, "quant") else 0

    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    streamed = sum(size(lin) for lin in linears) + size(model.lm_head)
    norms = sum(size(t) for layer in model.layers for t in (layer.input_norm, layer.post_norm))
    shared_head = model.lm_head.quant is not None and model.lm_head.quant is model.embed
    return {"streamed_per_token": streamed, "held": streamed + norms + (0 if shared_head else size(model.embed))}


def child(path: str, kv_tokens: int, threads: int, dtype: str = "bfloat16", dequantize: bool = False,
          activations: str = "auto") -> None:
    """Loads the file, reports, then serves single-stream runs on the commands read from stdin. With `dequantize`
    the block tensors are dequantized to the engine's dtype at load, as where no quantized kernel runs;
    `activations` is the engine's quantized_activations."""
    from ._llamacpp import single_ours
    from .harness import warm_up
    from ..kernels import quant_linear
    from ..kernels import runner as runner_module
    from ..scheduler import Engine

    if dequantize:
        runner_module.keeps_blocks = lambda *_: False
    start = time.perf_counter()
    engine = Engine(path, dtype=dtype, num_threads=threads, kv_cache_tokens=kv_tokens, context_length=kv_tokens,
                    max_running_requests=4, quantized_activations=activations)
    runner = engine.runner
    kernel = None if dequantize else quant_linear.kernel(runner.dtype)
    loaded = {"load_s": time.perf_counter() - start, "after_load": vm_status(), "kernel": kernel,
              "int8_activations": runner.int8_activations,
              "dtype": str(runner.dtype).removeprefix("torch."),
              "kv_pool_bytes": runner.k_cache.nbytes + runner.v_cache.nbytes, **model_bytes(runner.model)}
    warm_up(engine)  # before the reply: the parent's next step (another child's load, a timed run) waits for it
    print(json.dumps(loaded), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            rates = single_ours(engine, int(cmd[1]), int(cmd[2]), int(cmd[3]))
            print(json.dumps(rates), flush=True)
        else:
            break
    engine.shutdown()
    print(json.dumps({"after_serve": vm_status()}), flush=True)


class Child:
    def __init__(self, path: str, kv_tokens: int, threads: int, dtype: str, dequantize: bool, activations: str) -> None:
        code = ("import sys; from radixserve.bench.gguf_memory import child; "
                "child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == '1', sys.argv[6])")
        self.proc = subprocess.Popen([sys.executable, "-c", code, path, str(kv_tokens), str(threads), dtype,
                                      str(int(dequantize)), activations],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")

    def reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the radixserve child exited (rc {self.proc.wait()})")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.reply()


def file_bytes_streamed(path: str) -> int:
    """llama.cpp's bytes per decode step: every tensor of the file but the embedding table (unless it is the head)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def llama_decode(binary: str, gguf: str, context: int, new_tokens: int, threads: int) -> dict[str, float]:
    """llama-bench's decode tokens/s of `new_tokens` after `context` tokens (-d: already in its KV cache)."""
    cmd = [binary, "-m", gguf, "-p", "0", "-n", str(new_tokens), "-d", str(context), "-t", str(threads), "-r", "1",
           "-o", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"llama-bench failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"decode_tok_s": float(rows[-1]["avg_ts"])}


def run(args) -> dict[str, Any]:
    from . import roofline
    from .peer_vllm import alternation

    if not os.path.isfile(args.gguf):
        from .checkpoints.gguf_random import SHAPES, write_random_gguf

        os.makedirs(os.path.dirname(os.path.abspath(args.gguf)), exist_ok=True)
        write_random_gguf(args.gguf, SHAPES[args.shape], "Q4_0")
    llama = args.llama_bench if os.path.isfile(args.llama_bench) else None
    ours, loaded, runs = {}, {}, []
    try:  # one child per --quantized-activations value, loaded one after the other, all kept for the alternation
        for value in args.quantized_activations.split(","):
            name = engine_name(value, args.quantized_activations)
            ours[name] = Child(args.gguf, args.kv_cache_tokens, args.threads, args.dtype, args.dequantize, value)
            loaded[name] = ours[name].reply()
        engines = [*ours, "llama.cpp"] if llama else list(ours)
        for child in ours.values():  # one untimed run at the timed shapes, as llama-bench makes its own warm-up run
            child.ask(f"run {args.context} {args.new_tokens} -1")
        for rep, order in enumerate(alternation(engines, args.runs)):
            for name in order:
                time.sleep(args.settle_s)
                rates = (ours[name].ask(f"run {args.context} {args.new_tokens} {rep}") if name in ours else
                         llama_decode(llama, args.gguf, args.context, args.new_tokens, args.threads))
                runs.append({"engine": name, "rep": rep, **rates})
        served = {name: child.ask("quit") for name, child in ours.items()}
    finally:
        for child in ours.values():
            child.proc.kill() if child.proc.poll() is None else None
    first = next(iter(ours))  # the memory figures are the first child's (each engine is its own process)
    bandwidth = roofline.measure_stream_gbs(int(args.stream_gib * 2**30 / 4), args.threads)
    return {"gguf": args.gguf, "file_bytes": os.path.getsize(args.gguf), "context": args.context,
            "new_tokens": args.new_tokens, "threads": args.threads, "kv_cache_tokens": args.kv_cache_tokens,
            **loaded[first], **served[first], "engines": {n: {**loaded[n], **served[n]} for n in ours},
            "runs": runs, "read_gbs": bandwidth,
            "llama_streamed_per_token": file_bytes_streamed(args.gguf), "load": os.getloadavg()[0]}


def engine_name(value: str, values: str) -> str:
    """radixserve's name in the runs: plain with one --quantized-activations value, else tagged with it."""
    return "radixserve" if "," not in values else f"radixserve ({value})"


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2 if s else float("nan")


def report(r: dict[str, Any]) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    budget = r["file_bytes"] + r["kv_pool_bytes"]
    peak = max(r["after_load"]["VmHWM"], r["after_serve"]["VmHWM"])
    names = list(dict.fromkeys(x["engine"] for x in r["runs"]))
    decode = {e: median([x["decode_tok_s"] for x in r["runs"] if x["engine"] == e]) for e in names}
    floor_ours = r["read_gbs"] * 1e9 / r["streamed_per_token"]
    floor_file = r["read_gbs"] * 1e9 / r["llama_streamed_per_token"]
    lines = [f"# GGUF memory and decode: {os.path.basename(r['gguf'])}", "",
             f"File {gb(r['file_bytes'])}, KV pool {gb(r['kv_pool_bytes'])} ({r['kv_cache_tokens']} tokens, "
             f"{r.get('dtype', 'bfloat16')}); quantized kernel {r['kernel'] or 'none (blocks dequantized at load)'}, "
             f"{r['threads']} threads, load average {r['load']:.1f} at the end.", "",
             "| measure | value |", "|---|---|",
             f"| weights held by the engine | {gb(r['held'])} ({r['held'] / r['file_bytes']:.2f}x the file) |",
             f"| peak RSS after load (VmHWM) | {gb(r['after_load']['VmHWM'])} |",
             f"| peak RSS after serving | {gb(r['after_serve']['VmHWM'])} |",
             f"| peak / (file + KV pool) | **{peak / budget:.2f}x** (target <= {TARGET}x) |",
             f"| load time | {r['load_s']:.0f} s |",
             *(f"| decode tok/s at {r['context']} context, {e}{' (same file)' if e == 'llama.cpp' else ''} | "
               f"{decode[e]:.2f} |" for e in names),
             f"| floor: read {r['read_gbs']:.1f} GB/s / our {gb(r['streamed_per_token'])} per token | "
             f"{floor_ours:.2f} tok/s |",
             f"| floor: read / the file's {gb(r['llama_streamed_per_token'])} per token | {floor_file:.2f} tok/s |"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = bench_parser("gguf_memory", __doc__)
    parser.add_argument("--gguf", default=DEFAULT_GGUF, help="the GGUF file (written first where missing)")
    parser.add_argument("--shape", default="llama-3.1-8b", help="the shape a missing file is written in")
    parser.add_argument("--kv-cache-tokens", type=int, default=4096)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="the engine's --dtype (auto: float32 without bf16 flags)")
    parser.add_argument("--dequantize", action="store_true",
                        help="dequantize the block tensors at load (what runs where no quantized kernel does)")
    parser.add_argument("--quantized-activations", default="auto",
                        help="the engine's --quantized-activations; a comma list runs one engine per value, alternating")
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--stream-gib", type=float, default=1.0, help="the bandwidth measurement's buffer")
    parser.add_argument("--llama-bench", default=LLAMA_BENCH, help="llama.cpp's llama-bench (skipped if absent)")
    args = parse_args(parser, argv)
    out = BenchOutput("gguf_memory", args.out)
    result = run(args)
    stem = "gguf_memory_" + os.path.basename(args.gguf).removesuffix(".gguf") + (
        "" if args.dtype == "bfloat16" else f"_{args.dtype}") + ("_dequantized" if args.dequantize else "") + (
        "" if args.quantized_activations == "auto" else "_act-" + args.quantized_activations.replace(",", "-"))
    table = report(result)
    out.write_report(stem, result, table)
    out.finish(table)


if __name__ == "__main__":
    main()
