"""Device check for the Triton attention kernels (python -m radixserve.bench.device_check).

On a CUDA machine: checks the Triton kernels against the torch reference (bf16, and fp32
at a tight tolerance that TF32 would fail), times them against the reference and against
torch SDPA on contiguous KV (CUDA events over CUDA-graph replays, after a warm-up), reports
decode's achieved memory bandwidth (bytes of K/V read / time), and writes
device_check.{json,md} (bench/output.py says where). Without CUDA it prints what it would
measure and exits 0. ``--compile-check`` compiles the kernels for sm_90 without any GPU.
"""
from __future__ import annotations

import logging
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .output import BenchOutput, bench_parser, parse_args, progress
from ..kernels.attention.base import AttentionMetadata
from ..kernels.attention.metadata import meta_from_slot_lists

logger = logging.getLogger(__name__)

BF16_ATOL = 2e-2  # bf16 keeps 8 mantissa bits; outputs are O(1)
FP32_ATOL = 1e-5  # a TF32 dot (10-bit mantissa) would miss this by ~100x on short contexts
SM90_SHARED_BYTES = 232448  # H100/H200 per-block shared memory (opt-in maximum)


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "extend"
    num_seqs: int
    prefix_len: int  # cached tokens per sequence (decode: the whole context before the new token)
    q_len: int  # new tokens per sequence (1 for decode)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    sliding_window: int | None = None

    @property
    def label(self) -> str:
        window = f" window={self.sliding_window}" if self.sliding_window else ""
        return (f"{self.kind} bs={self.num_seqs} prefix={self.prefix_len} q={self.q_len} "
                f"heads={self.num_q_heads}/{self.num_kv_heads} d={self.head_dim}{window}")


# Llama-3-8B-like heads; contexts sized so each case runs in well under a second.
CASES = [
    Case("decode", 1, 8191, 1),
    Case("decode", 32, 2047, 1),
    Case("decode", 128, 1023, 1),
    Case("decode", 64, 4095, 1, num_q_heads=32, num_kv_heads=32),
    Case("decode", 32, 4095, 1, sliding_window=1024),
    Case("extend", 1, 0, 4096),
    Case("extend", 4, 1024, 512),
    Case("extend", 16, 300, 37),
    Case("extend", 2, 3000, 1000, sliding_window=1024),
]
# Small shapes for the GPU test: GQA 4 and 7, MHA, head_dim 64 and 128, windows, split-K.
QUICK_CASES = [
    Case("decode", 4, 1000, 1),
    Case("decode", 3, 700, 1, num_q_heads=8, num_kv_heads=8, head_dim=64, sliding_window=256),
    Case("extend", 2, 100, 200),
    Case("extend", 3, 50, 77, num_q_heads=14, num_kv_heads=2, head_dim=64, sliding_window=64),
]


@dataclass
class PagedBatch:
    """A ragged batch over a pool whose pages are scattered (page order shuffled)."""

    meta: AttentionMetadata
    k_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    k_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], not yet stored
    v_new: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    slot_lists: list[list[int]] = field(default_factory=list)  # per seq, every position's slot


def make_paged_batch(prefix_lens: list[int], q_lens: list[int], *, page_size: int, num_kv_heads: int,
                     head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                     seed: int = 0, spare_pages: int = 3) -> PagedBatch:
    """Random K/V for a ragged batch: prefixes already in the pool, new tokens in k_new/v_new.

    Pages are handed out in a shuffled order so no sequence is contiguous. Slots that belong
    to nobody hold NaN (except page 0, which the reference gathers for padding), so a kernel
    that reads outside a sequence's range shows up as NaN in its output.
    """
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    pages_per_seq = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per_seq) + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    slot_lists, next_page = [], 0
    for kv_len, num_seq_pages in zip(kv_lens, pages_per_seq):
        pages = order[next_page:next_page + num_seq_pages]
        next_page += num_seq_pages
        slot_lists.append([pages[j // page_size] * page_size + j % page_size for j in range(kv_len)])

    # Random data is drawn on the target device: a GPU pool of millions of slots fills in ms.
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = dict(generator=gen, device=device, dtype=dtype)
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), device=device, dtype=dtype)
    v_cache = torch.full(shape, float("nan"), device=device, dtype=dtype)
    prefix_slots = [s for slots, p in zip(slot_lists, prefix_lens) for s in slots[:p]]
    idx = torch.tensor(sorted(set(range(page_size)) | set(prefix_slots)), dtype=torch.long, device=device)
    k_cache[idx] = torch.randn((idx.numel(), num_kv_heads, head_dim), **rand)
    v_cache[idx] = torch.randn((idx.numel(), num_kv_heads, head_dim), **rand)
    num_tokens = sum(q_lens)
    k_new = torch.randn((num_tokens, num_kv_heads, head_dim), **rand)
    v_new = torch.randn((num_tokens, num_kv_heads, head_dim), **rand)

    meta = make_meta(prefix_lens, q_lens, slot_lists, device)
    return PagedBatch(meta, k_cache, v_cache, k_new, v_new, slot_lists)


def make_meta(prefix_lens: list[int], q_lens: list[int], slot_lists: list[list[int]],
              device: str | torch.device) -> AttentionMetadata:
    """Metadata for one step; slot_lists[i] holds the slots of positions 0 .. kv_len - 1."""
    return meta_from_slot_lists(prefix_lens, q_lens, slot_lists, device)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("device_check", __doc__)
    parser.add_argument("--quick", action="store_true", help="four small cases instead of the full set (a smoke test)")
    parser.add_argument("--dry-run", action="store_true", help="only print what would be measured")
    parser.add_argument("--compile-check", action="store_true",
                        help="also compile the kernels for sm_90 (no GPU needed; needs TRITON_INTERPRET unset)")
    args = parse_args(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cases = QUICK_CASES if args.quick else CASES
    out = BenchOutput("device_check", args.out)
    if args.compile_check and not compile_check():
        return 1
    if args.dry_run or not torch.cuda.is_available():
        _print_plan(cases, out.dir)
        return 0
    import triton

    from ..kernels.attention.triton_store import kernels_interpreted

    if kernels_interpreted():
        raise ValueError("TRITON_INTERPRET is set: unset it to time compiled kernels on the GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be exact fp32 too
    started = time.perf_counter()
    with progress(len(cases), "device check", unit="case") as bar:
        rows = []
        for case in cases:
            rows.append(_run_case(case))
            bar.update()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "bf16_atol": BF16_ATOL,
        "fp32_atol": FP32_ATOL,
        "wall_s": round(time.perf_counter() - started, 1),
        "cases": rows,
    }
    out.finish(_write(report, out))
    failed = [r["case"] for r in rows if not r["ok"]]
    if failed:
        logger.error("accuracy check FAILED for: %s", failed)
        return 1
    return 0


def compile_check(arch: int = 90) -> bool:
    """Compile each kernel (production bf16 tiles, and fp32 with the largest tiles) for a CUDA
    arch through ptxas, without a GPU: catches GPU-only errors (tl.dot shapes, dtypes,
    input_precision) and shared-memory overuse on CPU-only CI."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..kernels.attention import triton_decode, triton_extend, triton_store

    if triton_store.kernels_interpreted():
        raise ValueError("compile_check needs compiled kernels: unset TRITON_INTERPRET")
    precision = triton_extend.DOT_PRECISION  # what the wrappers pass
    store, extend = triton_store._store_kv_kernel, triton_extend._extend_kernel
    split, merge = triton_decode._decode_split_kernel, triton_decode._decode_merge_kernel
    variants = [  # (kernel, dtype, constexprs), tiles as the wrappers pick them for 32 q / 8 kv heads, d 128
        (store, "bf16", dict(BLOCK_T=4, BLOCK_E=1024)),
        # HAS_OWN_START / WRITE_LSE: the cascade options (own_start bound, LSE output); off = plain.
        (extend, "bf16", dict(BLOCK_M=16, BLOCK_G=4, BLOCK_N=64, BLOCK_D=128, PRECISION=precision,
                              HAS_OWN_START=False, WRITE_LSE=False)),
        (extend, "fp32", dict(BLOCK_M=32, BLOCK_G=1, BLOCK_N=32, BLOCK_D=128, PRECISION=precision,
                              HAS_OWN_START=True, WRITE_LSE=True)),
        (split, "bf16", dict(BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, PRECISION=precision, DIRECT=False,
                             HAS_OWN_START=True, WRITE_LSE=True)),
        (split, "fp32", dict(BLOCK_H=16, BLOCK_N=32, BLOCK_D=128, PRECISION=precision, DIRECT=True,
                             HAS_OWN_START=False, WRITE_LSE=False)),
        (merge, "bf16", dict(BLOCK_S=16, BLOCK_D=128, WRITE_LSE=True)),
    ]
    ok = True
    for kernel, dtype, constexprs in variants:
        signature = {name: _arg_type(name, dtype) for name in kernel.arg_names}
        signature.update({name: "constexpr" for name in constexprs})
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 2})
        fits = compiled.metadata.shared <= SM90_SHARED_BYTES
        # fp32 tiles must multiply in true fp32: no TF32 tensor-core instruction in the PTX.
        no_tf32 = dtype != "fp32" or "tf32" not in compiled.asm["ptx"]
        ok &= fits and no_tf32
        print(f"compiled {kernel.__name__} {dtype} {constexprs} for sm_{arch}: "
              f"{compiled.metadata.shared} B shared memory{'' if fits else ' (TOO MUCH)'}"
              f"{'' if no_tf32 else ', USES TF32'}")
    return ok


def _arg_type(name: str, dtype: str) -> str:
    if name in ("qo_indptr_ptr", "kv_indptr_ptr", "kv_lens_ptr", "own_start_ptr"):
        return "*i32"
    if name == "lse_ptr":
        return "*fp32"
    if name in ("kv_indices_ptr", "slot_ids_ptr"):
        return "*i64"
    if name.startswith("mid_"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*" + dtype
    return "fp32" if name == "qk_scale" else "i32"


def _run_case(case: Case, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    from ..kernels.attention import torch_ref, triton_decode, triton_extend, triton_store

    is_decode = case.kind == "decode"
    kernel = triton_decode.decode_attention if is_decode else triton_extend.extend_attention
    reference = torch_ref.decode_attention if is_decode else torch_ref.extend_attention
    batch = make_paged_batch([case.prefix_len] * case.num_seqs, [case.q_len] * case.num_seqs,
                             page_size=case.page_size, num_kv_heads=case.num_kv_heads,
                             head_dim=case.head_dim, dtype=dtype, device=device)
    meta, k_cache, v_cache = batch.meta, batch.k_cache, batch.v_cache
    num_tokens = case.num_seqs * case.q_len
    q = torch.randn((num_tokens, case.num_q_heads, case.head_dim), device=device,
                    dtype=dtype)  # [num_tokens, num_q_heads, head_dim]
    sm_scale = case.head_dim ** -0.5

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(ref_k, ref_v, batch.k_new, batch.v_new, meta.out_slot_ids)
    triton_store.store_kv(k_cache, v_cache, batch.k_new, batch.v_new, meta.out_slot_ids)
    store_ok = bool(torch.equal(ref_k.nan_to_num(), k_cache.nan_to_num())
                    and torch.equal(ref_v.nan_to_num(), v_cache.nan_to_num()))
    del ref_k, ref_v

    k32, v32, q32 = k_cache.float(), v_cache.float(), q.float()
    window = case.sliding_window
    expected = reference(q32, k32, v32, meta, sm_scale, window)  # [num_tokens, num_q_heads, head_dim] fp32
    err_bf16 = _max_err(kernel(q, k_cache, v_cache, meta, sm_scale, window), expected)
    err_fp32 = _max_err(kernel(q32, k32, v32, meta, sm_scale, window), expected)
    del k32, v32, q32, expected
    if device == "cuda":
        torch.cuda.empty_cache()

    k_new, v_new, slots = batch.k_new, batch.v_new, meta.out_slot_ids
    row = {
        "case": case.label, **asdict(case),
        "store_ok": store_ok, "max_err_bf16": err_bf16, "max_err_fp32": err_fp32,
        "ok": store_ok and err_bf16 <= BF16_ATOL and err_fp32 <= FP32_ATOL,
        # Kernel time from CUDA-graph replays (no Python launch overhead), and eager for contrast.
        "store_ms": _time_graph_ms(lambda: triton_store.store_kv(k_cache, v_cache, k_new, v_new, slots)),
        "triton_ms": _time_graph_ms(lambda: kernel(q, k_cache, v_cache, meta, sm_scale, window)),
        "triton_eager_ms": _time_ms(lambda: kernel(q, k_cache, v_cache, meta, sm_scale, window)),
        "torch_ref_ms": _time_ms(lambda: reference(q, k_cache, v_cache, meta, sm_scale, window), iters=5),
        **_time_sdpa(case, q),
    }
    visible = [min(n, window) if window else n for n in meta.kv_lens_list]  # decode reads only these
    kv_bytes = sum(visible) * case.num_kv_heads * case.head_dim * 2 * k_cache.element_size()
    row["kv_gb_per_s"] = kv_bytes / row["triton_ms"] / 1e6 if is_decode else None
    row["sdpa_kv_gb_per_s"] = kv_bytes / row["sdpa_ms"] / 1e6 if is_decode else None
    causal_pairs = case.num_seqs * _visible_pairs(case.prefix_len, case.q_len, window)
    row["triton_tflops"] = 4 * causal_pairs * case.num_q_heads * case.head_dim / row["triton_ms"] / 1e9
    logger.info("%s: err bf16 %.2e fp32 %.2e, triton %.3f ms, ref %.3f ms, sdpa %.3f ms",
                case.label, err_bf16, err_fp32, row["triton_ms"], row["torch_ref_ms"], row["sdpa_ms"])
    return row


def _time_sdpa(case: Case, q: torch.Tensor) -> dict:
    """SDPA over the same shapes with each sequence's KV contiguous (the no-paging baseline)."""
    kv_len = case.prefix_len + case.q_len
    q4 = q.view(case.num_seqs, case.q_len, case.num_q_heads, case.head_dim).transpose(1, 2)  # [b, hq, q, d]
    k4 = torch.randn((case.num_seqs, case.num_kv_heads, kv_len, case.head_dim), device=q.device,
                     dtype=q.dtype)  # [b, hkv, kv, d]
    v4 = torch.randn_like(k4)
    mask = None
    # SDPA's is_causal is top-left aligned: a prefix offset or a window needs an explicit mask.
    if (case.q_len > 1 and case.prefix_len > 0) or case.sliding_window:
        pos = torch.arange(case.q_len, device=q.device)[:, None] + case.prefix_len  # [q, 1]
        col = torch.arange(kv_len, device=q.device)[None, :]  # [1, kv]
        mask = (col <= pos) & (col > pos - case.sliding_window if case.sliding_window else True)  # [q, kv]
    causal = case.q_len > 1 and mask is None

    def run() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal,
                                              scale=case.head_dim ** -0.5, enable_gqa=True)
    try:
        run()
        note = "enable_gqa"
    except RuntimeError as exc:  # no GQA support in this build's kernels: expand K/V outside the timing
        logger.warning("SDPA enable_gqa failed (%s); timing with K/V expanded to all q heads", exc)
        group = case.num_q_heads // case.num_kv_heads
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        note = "kv expanded"
    return {"sdpa_ms": _time_graph_ms(run), "sdpa_note": note}


def _time_graph_ms(fn, iters: int = 20, replays: int = 10) -> float:
    """Median GPU time of fn (ms) from CUDA-graph replays; eager timing if capture fails."""
    for _ in range(3):  # warm-up: compiles Triton kernels and settles allocations before capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        logger.warning("CUDA graph capture failed (%s); timing eagerly", exc)
        torch.cuda.synchronize()
        return _time_ms(fn)
    return _time_ms(graph.replay, iters=iters, repeat=replays)


def _time_ms(fn, warmup: int = 3, iters: int = 20, repeat: int = 1) -> float:
    """Median CUDA-event time of one call of fn in ms (each sample = `repeat` back-to-back calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeat)
    return statistics.median(times)


def _visible_pairs(prefix_len: int, q_len: int, window: int | None) -> int:
    """(query, key) pairs one sequence computes: each query sees min(pos + 1, window) keys."""
    return sum(min(pos + 1, window or pos + 1) for pos in range(prefix_len, prefix_len + q_len))


def _max_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected).abs().max())


def _print_plan(cases: list[Case], out_dir: str) -> None:
    print("No CUDA device (or --dry-run): nothing measured. On a CUDA machine this script would:")
    print("  - check Triton store/extend/decode against the torch reference in bf16 (atol 2e-2) "
          "and in fp32 (atol 1e-5, which TF32 dots would fail)")
    print("  - time each (CUDA events over CUDA-graph replays, warm-up, median) against the torch "
          "reference and torch SDPA on contiguous KV")
    print("  - report decode's achieved memory bandwidth = bytes of K/V read / kernel time")
    print(f"  - write device_check.json and device_check.md to {out_dir}/")
    print("Cases (bf16, pages of 16 slots placed non-contiguously):")
    for case in cases:
        print(f"  {case.label}")


def _write(report: dict, out: BenchOutput) -> str:
    """Writes device_check.{json,md}; returns the Markdown."""
    lines = [f"# Triton attention device check ({report['device']})", "",
             f"torch {report['torch']}, triton {report['triton']}; bf16, pages of 16 scattered slots. "
             "Median ms per call from CUDA-graph replays (eager: with Python launch overhead); "
             "speed-up = other ms / triton ms; errors = max abs vs an fp32 reference.", "",
             "| case | err bf16 | err fp32 | triton ms | eager ms | torch ref ms | SDPA ms | vs ref | vs SDPA "
             "| KV GB/s (SDPA) | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["cases"]:
        gbps = "-" if r["kv_gb_per_s"] is None else f"{r['kv_gb_per_s']:.0f} ({r['sdpa_kv_gb_per_s']:.0f})"
        lines.append(f"| {r['case']} | {r['max_err_bf16']:.1e} | {r['max_err_fp32']:.1e} | {r['triton_ms']:.3f} "
                     f"| {r['triton_eager_ms']:.3f} | {r['torch_ref_ms']:.3f} | {r['sdpa_ms']:.3f} "
                     f"| {r['torch_ref_ms'] / r['triton_ms']:.1f}x | {r['sdpa_ms'] / r['triton_ms']:.2f}x "
                     f"| {gbps} | {r['triton_tflops']:.1f} |")
    return out.write_report("device_check", report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
