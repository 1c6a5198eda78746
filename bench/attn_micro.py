"""Microbenchmark of the native CPU attention kernel (kernels/cpu_kernels.c, rs_attend) on one layer of
a model's shapes, the calls the CPU backend makes for a workload like gsp_long (torch_plan.py):

- decode_shared: B decodes below one P-token shared prefix, read once for all B x group rows (merged);
- decode_own: each decode's own keys (a suffix plus what it generated, OWN keys each);
- prefill_causal: one P-token chunk, causal, in units of QUERY_BLOCK queries (one call each);
- prefill_shared: B suffixes of S tokens below the shared prefix (merged), as the second prefill step.

    python -m radixserve.bench.attn_micro [--dtype bf16] [--threads 2] [--lib path/to/old.so] [--reps 5]

``--lib`` times another build of the library (e.g. compiled from an older commit's sources with
native.py's flags; with ``--widen`` where it predates the vdpbf16ps products) through the same calls,
for before / after figures. Each case reports the median and the minimum of ``--reps`` timed calls
(after one warm-up) in ms, GFLOP/s of the two products at the median, and the median and minimum
CPU time of the process (on a loaded machine, with ``--threads 1``, the steadier figures: time the
process was not running is left out).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from ..kernels import native
from ..kernels.attention.torch_plan import QUERY_BLOCK


def _cases(p: int, b: int, s: int, own: int, q_heads: int, kv_heads: int, d: int, dtype: torch.dtype):
    """(name, q, pool k, pool v, slots, (lo, hi), tokens, merge, pairs of (query row, key)) per call."""
    group = q_heads // kv_heads
    gen = torch.Generator().manual_seed(0)
    pool = p + b * (s + own) + 16
    k = torch.randn(pool, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(pool, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(max(p, b * s), q_heads, d, generator=gen).to(dtype)
    i32 = dict(dtype=torch.int32)
    prefix = torch.arange(p)[None, :]
    yield ("decode_shared", q[:b], k, v, prefix, (None, torch.full((1, b * group), p, **i32)),
           torch.arange(b, **i32)[None, :], True, b * group * p)
    own_slots = p + torch.arange(b * own).view(b, own)
    yield ("decode_own", q[:b], k, v, own_slots, (None, torch.full((b, group), own, **i32)),
           torch.arange(b, **i32)[:, None], False, b * group * own)
    calls = []
    for u0 in range(0, p, QUERY_BLOCK):
        n = min(QUERY_BLOCK, p - u0)
        hi = (u0 + 1 + torch.arange(n, **i32)).repeat_interleave(group)[None, :].contiguous()
        calls.append((prefix[:, :u0 + n], (None, hi), (u0 + torch.arange(n, **i32))[None, :]))
    yield ("prefill_causal", q[:p], k, v, calls, None, None, False, sum(int(c[1][1].sum()) for c in calls))
    yield ("prefill_shared", q[:b * s], k, v, prefix, (None, torch.full((1, b * s * group), p, **i32)),
           torch.arange(b * s, **i32)[None, :], True, b * s * group * p)


def _run(q, k, v, slots, bounds, tokens, merge, out, lse, scale):
    if isinstance(slots, list):  # several calls (the prefill's units)
        for sl, bd, tok in slots:
            native.attend_tokens(q, k, v, sl, bd, tok, scale, out, lse, merge)
    else:
        native.attend_tokens(q, k, v, slots, bounds, tokens, scale, out, lse, merge)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lib", help="another build of the native library to time instead")
    ap.add_argument("--widen", action="store_true", help="bf16 widened for FMAs (no AMX / vdpbf16ps products)")
    ap.add_argument("--cases", default="decode_shared,decode_own,prefill_causal,prefill_shared")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--own", type=int, default=96, help="own keys of each decode")
    ap.add_argument("--shape", default="14,2,64", help="q heads, kv heads, head dim (model L: 14,2,64)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.lib:
        lib = ctypes.CDLL(args.lib)
        lib.rs_attend.argtypes, lib.rs_attend.restype = [ctypes.POINTER(native._Args)], ctypes.c_int
        lib.rs_isa.restype, lib.rs_amx_ready.restype = ctypes.c_char_p, ctypes.c_int
        native.load = lambda: lib
    if args.widen:
        native._products = lambda bf16, i8=False: 0
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hq, hkv, d = (int(x) for x in args.shape.split(","))
    print(f"{native.status()} lib={args.lib or 'current'} {args.dtype} products={native._products(True)} "
          f"threads={args.threads}")
    for name, q, k, v, slots, bounds, tokens, merge, pairs in _cases(
            args.prefix, args.batch, args.suffix, args.own, hq, hkv, d, dtype):
        if name not in args.cases.split(","):
            continue
        out = torch.zeros(q.shape, dtype=torch.float32)
        lse = torch.zeros(q.shape[:2], dtype=torch.float32)
        _run(q, k, v, slots, bounds, tokens, merge, out, lse, d ** -0.5)
        times, cpu = [], []
        for _ in range(args.reps):
            t0, c0 = time.perf_counter(), time.process_time()
            _run(q, k, v, slots, bounds, tokens, merge, out, lse, d ** -0.5)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
        med, cpu_med = statistics.median(times), statistics.median(cpu)
        print(f"{name:15s} median {med:8.3f} ms  min {min(times):8.3f} ms  {4 * d * pairs / med / 1e6:6.1f} GFLOP/s"
              f"  cpu {cpu_med:8.3f} ms ({4 * d * pairs / cpu_med / 1e6:6.1f} GFLOP/s a cpu-second) min {min(cpu):8.3f}")


if __name__ == "__main__":
    main()
