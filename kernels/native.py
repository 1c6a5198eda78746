"""radixserve's compiled CPU kernels (``cpu_*.c``): build once per machine, load, call.

``attend_paged`` / ``attend_tokens`` are the attention over the paged KV pool that the CPU attention
backend reads with (kernels/attention/torch_backend.py), fp32 or bf16 (fp32 sums either way; in bf16
on AMX tiles where the CPU has AMX-BF16, ``_use_amx``), or q in either over an int8 pool
(attention/kv_int8.py); ``argmax_rows`` is the sampler's greedy
argmax; ``linear_bf16`` the few-row bf16 linears, ``linear_tiles`` the packed ones. The C sources (over
one vector layer, ``cpu_simd.h``, written per instruction set) are compiled on first use with the system C compiler
(``$CC``, else ``cc``) for one of ``ISAS``: AVX-512, AVX2 + FMA, or the portable build with the
compiler's baseline flags, each with explicit ``-m`` flags (never ``-march=native``, so nothing built
here assumes more than the named instruction set; AVX512-BF16 and AMX code sits behind function
target attributes and runs only where the CPU has them). The best variant the running CPU's flags
allow is chosen at load time; ``RADIXSERVE_NATIVE_ISA`` (read in ``chosen_isa``) forces one.
Libraries live in the private radixserve cache (kernels/cache_dir.py), named by a key of the
sources, the compiler's version and the variant's flags, so one built for another CPU or compiler
is never loaded. They link libgomp, which resolves to the copy torch has already loaded, so kernel
and torch share one OpenMP runtime. Where no variant can be had (not Linux, no compiler, the build
fails) ``load()`` returns None and says why once, as a WARNING; the backend then reads through
torch's flash op (partials.attend_tokens, the same contract as ``attend_tokens``). ``status()``
names what is in use.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention.kv_int8 import Int8KV
from .cache_dir import private_cache_dir, refusal
from .loader import cpu_flags as this_cpu_flags

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_kernels.c", "cpu_argmax.c", "cpu_linear.c", "cpu_linear_amx.c", "cpu_linear_dp.c",
                             "cpu_quant.c", "cpu_quant_vec.c", "cpu_quant_f32.c", "cpu_quant_i8.c", "cpu_qview.h",
                             "cpu_simd.h", "cpu_tiles.h", "cpu_amx.h", "cpu_attn_few.c", "cpu_attn.h", "cpu_attn_dp.h",
                             "cpu_pointwise.c"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
MAX_HEAD_DIM = 128  # DMAX in the source; head_dim must also be a multiple of 32
DTYPES = (torch.float32, torch.bfloat16)  # of q, K and V alike (the model's dtype), or of q over an int8 pool
ISA_ENV = "RADIXSERVE_NATIVE_ISA"
FALLBACK_COST = "attention falls back to torch's flash op, ~1.5-2.5x slower"


@dataclass(frozen=True)
class Isa:
    """A build of the kernel: the /proc/cpuinfo flags it needs and the compiler flags that target them."""

    name: str  # what the library's rs_isa() reports (cpu_simd.h's RS_ISA)
    cpu_flags: tuple[str, ...]
    cc_flags: tuple[str, ...]


ISAS = (  # best first
    Isa("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma")),
    Isa("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),  # every AVX2 CPU has F16C
    Isa("portable", (), ()),  # the compiler's baseline for the target (SSE2 on x86-64)
)
ISA_NAMES = tuple(isa.name for isa in ISAS)


class Unavailable(Exception):
    """Why no native kernel can be had here (load() logs it once and returns None)."""


class _Args(ctypes.Structure):
    """cpu_kernels.c's args_t, field for field."""

    _fields_ = [(name, kind) for names, kind in [
        ("q", ctypes.c_void_p), (("q_sb", "q_sh", "q_sr"), ctypes.c_int64),
        (("kc", "vc"), ctypes.c_void_p), (("kv_ss", "kv_sh"), ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("slots_sb", ctypes.c_int64),
        (("lo", "hi"), ctypes.c_void_p), ("bnd_sb", ctypes.c_int64),
        ("tok", ctypes.c_void_p), ("tok_sb", ctypes.c_int64),
        ("out", ctypes.c_void_p), (("o_sb", "o_sh", "o_sr"), ctypes.c_int64),
        ("lse", ctypes.c_void_p), (("l_sb", "l_sh", "l_sr"), ctypes.c_int64),
        (("num_b", "num_h", "num_rows", "num_keys", "d", "group", "merge", "num_threads", "bf16", "prod", "kv_i8"),
         ctypes.c_int32),
        ("scale", ctypes.c_float),
        (("ks", "vs"), ctypes.c_void_p), (("sc_ss", "sc_sh"), ctypes.c_int64),
    ] for name in ((names,) if isinstance(names, str) else names)]


def runnable_isas(cpu_flags: set[str] | None = None) -> list[str]:
    """The ISAS this CPU can run (best first; "portable" always)."""
    flags = set(this_cpu_flags()) if cpu_flags is None else cpu_flags
    return [isa.name for isa in ISAS if set(isa.cpu_flags) <= flags]


def chosen_isa(cpu_flags: set[str] | None = None) -> Isa:
    """$RADIXSERVE_NATIVE_ISA (auto, or one of ISA_NAMES) resolved on this CPU: auto takes the best
    it can run. ValueError for another name; Unavailable for a forced one this CPU cannot run."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower() or "auto"
    if wanted != "auto" and wanted not in ISA_NAMES:
        raise ValueError(f"{ISA_ENV}={wanted!r}: expected auto or one of {', '.join(ISA_NAMES)}")
    flags = set(this_cpu_flags()) if cpu_flags is None else cpu_flags
    isa = next(isa for isa in ISAS if isa.name == (runnable_isas(flags)[0] if wanted == "auto" else wanted))
    if missing := [flag for flag in isa.cpu_flags if flag not in flags]:
        raise Unavailable(f"{ISA_ENV}={isa.name}, but this CPU has no {', '.join(missing)}")
    return isa


def cannot_build() -> str | None:
    """Why no variant can be built on this machine at all (tests skip there and only there), or None."""
    if platform.system() != "Linux":
        return f"needs Linux (OpenMP with the system C compiler), not {platform.system()}"
    if shutil.which(_cc()) is None:
        return f"no C compiler ({_cc()}) on PATH"
    return None


def _cc() -> str:
    return os.environ.get("CC", "cc")


def compiler_version(cc: str) -> str:
    """The first line of `cc --version` (part of the cache key: another compiler builds another library)."""
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"{cc} --version failed: {exc}") from exc
    if done.returncode != 0 or not done.stdout.strip():
        raise Unavailable(f"{cc} --version failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout.strip().splitlines()[0]


def library_name(isa: Isa, cc: str, version: str) -> str:
    """The cache file of this variant: keyed by the sources, the compiler (path and version) and every flag."""
    parts = [*(path.read_bytes() for path in SOURCES), cc.encode(), version.encode(),
             " ".join((*FLAGS, *isa.cc_flags)).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return f"cpu_kernels-{isa.name}-{key}.so"


def _build(target: Path, isa: Isa, cc: str) -> None:
    """Compile into a temp file beside the target, then rename (concurrent builds never see half a file)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, *isa.cc_flags, *(str(path) for path in SOURCES if path.suffix == ".c"), "-o", tmp, "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            raise Unavailable(f"{' '.join(cmd)} failed: {exc}") from exc
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask; a group-writable file is refused
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path, isa: Isa) -> ctypes.CDLL:
    """dlopen the library, type its entry points and check it was built for the variant asked for."""
    if (problem := refusal(path)) is not None:
        raise Unavailable(f"not loading {path}: {problem}")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise Unavailable(f"loading {path} failed: {exc}") from exc
    lib.rs_attend.argtypes, lib.rs_attend.restype = [ctypes.POINTER(_Args)], ctypes.c_int
    lib.rs_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int]
    lib.rs_argmax_rows.restype = None
    lib.rs_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.rs_linear_bf16.restype = ctypes.c_int
    lib.rs_linear_tiles.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.rs_linear_tiles.restype = ctypes.c_int
    lib.rs_linear_dp.argtypes, lib.rs_linear_dp.restype = lib.rs_linear_tiles.argtypes, ctypes.c_int
    lib.rs_linear_quant.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_int]
    lib.rs_linear_quant.restype = ctypes.c_int
    lib.rs_quant_rows.argtypes = lib.rs_linear_quant.argtypes
    lib.rs_quant_rows.restype = ctypes.c_int
    lib.rs_quant_dequant_t.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       *[ctypes.c_int64] * 5, ctypes.c_void_p, ctypes.c_int]
    lib.rs_quant_dequant_t.restype = ctypes.c_int
    for name, like in (("rs_quant_rows_f32", lib.rs_quant_rows), ("rs_quant_rows_i8", lib.rs_quant_rows),
                       ("rs_quant_dequant_f32", lib.rs_quant_dequant_t)):
        getattr(lib, name).argtypes, getattr(lib, name).restype = like.argtypes, ctypes.c_int  # fp32 x, y, out
    lib.rs_isa.argtypes, lib.rs_isa.restype = [], ctypes.c_char_p
    lib.rs_amx_ready.argtypes, lib.rs_amx_ready.restype = [], ctypes.c_int
    if lib.rs_isa().decode() != isa.name:  # e.g. a compiler whose defaults target more than the baseline
        raise Unavailable(f"{path} was asked for {isa.name} but compiled for {lib.rs_isa().decode()}")
    return lib


def _build_and_open() -> ctypes.CDLL:
    if (reason := cannot_build()) is not None:
        raise Unavailable(reason)
    isa, cc = chosen_isa(), _cc()
    name = library_name(isa, cc, compiler_version(cc))
    try:
        folder, problem = private_cache_dir("kernels")
    except OSError as exc:
        folder, problem = None, f"the radixserve cache cannot be created ({exc})"
    if problem is not None:
        return _build_in_temp_dir(name, isa, cc, problem)
    target = Path(folder) / name
    if not target.exists():
        logger.info("compiling the native CPU kernel (once, ~15 s)")
        _build(target, isa, cc)
    return _open(target, isa)


def _build_in_temp_dir(name: str, isa: Isa, cc: str, problem: str) -> ctypes.CDLL:
    """The cache is refused: build where no one else can write (mkdtemp: 0700, this user's), load, delete."""
    logger.warning("%s: compiling the native CPU kernel into a fresh private temp dir instead, on every start "
                   "(~15 s); make the cache folder yours and private (chmod 700), or set RADIXSERVE_CACHE "
                   "to one that is", problem)
    with tempfile.TemporaryDirectory(prefix="radixserve-kernel-") as tmp:
        _build(Path(tmp) / name, isa, cc)
        return _open(Path(tmp) / name, isa)  # the mapping outlives the file


@functools.lru_cache(maxsize=1)
def _state() -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = _build_and_open()
    except Unavailable as exc:
        logger.warning("native CPU kernel unavailable (%s): %s", exc, FALLBACK_COST)
        return None, f"unavailable: {exc}"
    return lib, f"native {lib.rs_isa().decode()}"


def load() -> ctypes.CDLL | None:
    """The library (ctypes, entry points typed), built on first use, or None where it cannot be had
    here (logged once as a WARNING). ValueError when $RADIXSERVE_NATIVE_ISA names no variant."""
    return _state()[0]


def status() -> str:
    """What load() gives, in words: "native avx512" / "native avx2" / "native portable", or
    "unavailable: <why>" (builds the library on first use, as load())."""
    return _state()[1]


def reset() -> None:
    """Forget the loaded library, so that the next load() looks again (after a change of $CC, the
    cache or $RADIXSERVE_NATIVE_ISA: tests), and every choice made from it."""
    _state.cache_clear()
    _use_dpbf16.cache_clear()
    _use_amx.cache_clear()


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the kernel can serve these K/V (and is built)."""
    return (device.type == "cpu" and dtype in DTYPES and head_dim % 32 == 0
            and head_dim <= MAX_HEAD_DIM and load() is not None)


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None,
                 bounds: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, h, rows, d] over keys read in place from the pool: key j of entry b is
    slot ``slots[b, j]`` of k_cache / v_cache [slots, h, d] (slots None: slot j, for a view of a
    run of the pool). ``bounds`` = (lo, hi), int32 [b, rows] with the same strides: row r sees keys
    [lo, hi) (None: all; lo None: from 0).
    Returns (out [b, h, rows, d] float32, natural-log LSE [b, h, rows]); a row that sees no key
    gets out 0 and LSE -inf. q, K and V share one of DTYPES, or K and V are int8 pools (kv_int8.Int8KV, one
    layout) read by q in one of DTYPES; every tensor's last dimension must be
    contiguous; ``supports`` must hold."""
    num_b, num_h, rows, d = q.shape
    if out is None:
        out = torch.empty((num_b, num_h, rows, d), dtype=torch.float32)
    lse = torch.empty((num_b, num_h, rows), dtype=torch.float32)
    _call(q, q.stride()[:3], k_cache, v_cache, slots, bounds, None, 1, out, out.stride()[:3], lse,
          lse.stride(), num_b, num_h, rows, scale, merge=False)
    return out, lse


def attend_tokens(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None,
                  bounds: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor, scale: float,
                  out: torch.Tensor, lse: torch.Tensor, merge: bool) -> None:
    """attend_paged for rows named by token, reading q and writing out in place, token-major:
    q / out [num_tokens, q_heads, d], lse [num_tokens, q_heads] float32. Entry b's stacked row r
    is token ``tokens[b, r // group]`` (int32 [b, rows / group]; -1: padding, skipped), q head
    kv_head * group + r % group, with group = q_heads / kv_heads; ``bounds`` are per stacked row.
    merge: each row's result is log-sum-exp merged into the partial out / lse hold (over other
    keys), else it overwrites them. No token may appear twice in one call."""
    num_h, group = k_cache.shape[1], q.shape[1] // k_cache.shape[1]
    _call(q, _by_token(q, group), k_cache, v_cache, slots, bounds, tokens, group, out, _by_token(out, group), lse,
          _by_token(lse, group), tokens.shape[0], num_h, tokens.shape[1] * group, scale, merge)


def _by_token(t: torch.Tensor, group: int) -> tuple[int, int, int]:
    """Strides of a token-major [tokens, q_heads, ...] tensor as the kernel takes them: per token,
    per kv head (group q heads), per q head within the group."""
    return t.stride(0), group * t.stride(1), t.stride(1)


def _call(q, q_strides, k_cache, v_cache, slots, bounds, tokens, group, out, o_strides, lse, l_strides,
          num_b, num_h, rows, scale, merge) -> None:
    i8 = isinstance(k_cache, Int8KV)
    if q.dtype not in DTYPES or (i8 != isinstance(v_cache, Int8KV)) or (
            not i8 and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype)):
        raise ValueError(f"native attention takes q, K and V all float32 or all bfloat16, or q one of them over "
                         f"an int8 pool, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    scales = (k_cache.scale, v_cache.scale) if i8 else None
    if i8:
        k_cache, v_cache = k_cache.data, v_cache.data
        if scales[0].stride() != scales[1].stride() or k_cache.stride() != v_cache.stride():
            raise ValueError("native attention needs K and V (and their scales) laid out alike")
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"native attention writes float32 out and lse, got {out.dtype}, {lse.dtype}")
    bf16 = q.dtype == torch.bfloat16
    lo, hi = bounds if bounds is not None else (None, None)
    for name, t in (("lo", lo), ("hi", hi), ("tokens", tokens), ("slots", slots)):
        if t is not None and t.stride(-1) != 1:  # the kernel steps through their rows one by one
            raise ValueError(f"native attention needs {name} contiguous along its last dimension")
    args = _Args(q.data_ptr(), *q_strides, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                 k_cache.stride(1), _ptr(slots), 0 if slots is None else slots.stride(0), _ptr(lo), _ptr(hi),
                 0 if hi is None else hi.stride(0), _ptr(tokens), 0 if tokens is None else tokens.stride(0),
                 out.data_ptr(), *o_strides, lse.data_ptr(), *l_strides,
                 num_b, num_h, rows, slots.shape[1] if slots is not None else k_cache.shape[0], q.shape[-1],
                 group, int(merge), torch.get_num_threads(), int(bf16), _products(bf16, i8), int(i8), scale,
                 *((_ptr(scales[0]), _ptr(scales[1]), *scales[0].stride()[:2]) if i8 else (None, None, 0, 0)))
    if load().rs_attend(ctypes.byref(args)) != 0:
        raise ValueError(f"native attention refused head_dim {q.shape[-1]}, {rows} rows or group {group}")


def _products(bf16: bool, i8: bool = False) -> int:
    """How rs_attend multiplies bf16 in items of many rows: 1 on AMX tiles (``_use_amx``; never over an int8
    pool), 2 with vdpbf16ps (``_use_dpbf16``), 0 widened to fp32 for FMAs (and always for fp32 q)."""
    return 0 if not bf16 else 1 if _use_amx() and not i8 else 2 if _use_dpbf16() else 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D tensor (same answer: the first max, the first NaN where a row has
    one); through the native library for float32 on the CPU with contiguous rows, because torch's
    CPU argmax is a scalar loop."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1
            or x.shape[1] == 0 or load() is None):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().rs_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def linear_bf16_supported(weight: torch.Tensor) -> bool:
    """Whether ``linear_bf16`` can run this weight: a row-major bf16 [N, K] weight on the CPU (and the
    library is built)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.is_contiguous() and load() is not None)


@functools.lru_cache(maxsize=1)
def _use_amx() -> bool:
    """AMX tiles for bf16 attention (cpu_amx.h) where the CPU has AMX-BF16, the library is the AVX-512
    build and Linux grants this process the tile state."""
    flags = this_cpu_flags()
    return ({"amx_bf16", "amx_tile", "avx512_bf16"} <= set(flags) and load().rs_isa().decode() == "avx512"
            and load().rs_amx_ready() == 1)


@functools.lru_cache(maxsize=1)
def _use_dpbf16() -> bool:
    """vdpbf16ps where the CPU has it and the library is the AVX-512 build (cpu_linear.c)."""
    return "avx512_bf16" in this_cpu_flags() and load().rs_isa().decode() == "avx512"


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N], all bf16, fp32 sums rounded once: the few-row linears of
    a decode step (cpu_linear.c), streaming the weight as the checkpoint has it.
    ``linear_bf16_supported(weight)`` must hold."""
    x = x.contiguous()
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_bf16 takes x [M, {weight.shape[1]}] bf16, got {tuple(x.shape)} {x.dtype}")
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    load().rs_linear_bf16(x.data_ptr(), x.shape[0], weight.data_ptr(), weight.shape[0], weight.shape[1],
                          _ptr(bias), out.data_ptr(), torch.get_num_threads(), int(_use_dpbf16()))
    return out


def tiles_supported(weight: torch.Tensor) -> bool:
    """Whether ``linear_tiles`` can run this weight: bf16 [N, K] on the CPU with N a multiple of 16 and
    K of 32, where AMX tiles (``_use_amx``) or vdpbf16ps (``_use_dpbf16``) can be used."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and load() is not None
            and (_use_amx() or _use_dpbf16()))


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as the B operands of tdpbf16ps, [N / 16, K / 32, 16, 16, 2]: per 16 columns and 32
    inputs, 16 input pairs x 16 columns x the pair (cpu_linear_amx.c)."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def linear_tiles(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 dp: bool | None = None) -> torch.Tensor:
    """x [M, K] @ weight^T + bias with ``packed = pack_tiles(weight)``: all bf16, fp32 sums rounded once. On
    AMX tiles where ``_use_amx``, else with vdpbf16ps over the same layout (cpu_linear_dp.c); ``dp`` forces
    one (True: vdpbf16ps, where ``_use_dpbf16``)."""
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    x = x.contiguous()
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"linear_tiles takes x [M, {k}] bf16, got {tuple(x.shape)} {x.dtype}")
    out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
    dp = not _use_amx() if dp is None else dp
    if dp and not _use_dpbf16():  # the AVX512-BF16 code would fault
        raise ValueError("linear_tiles: vdpbf16ps is not available here")
    run = load().rs_linear_dp if dp else load().rs_linear_tiles
    if run(x.data_ptr(), x.shape[0], packed.data_ptr(), n, k, _ptr(bias), out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"linear_tiles: {'vdpbf16ps' if dp else 'AMX tiles'} not available here")
    return out


def tiles_ready() -> bool:
    """Whether AMX tile kernels run here (the library is built and ``_use_amx``): quant_linear.linear asks."""
    return load() is not None and _use_amx()
