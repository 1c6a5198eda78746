"""radixserve's compiled CPU kernels (``cpu_kernels.c``): build once per machine, load, call.

``attend_paged`` / ``attend_tokens`` are the attention over the paged KV pool that the CPU attention
backend reads with (kernels/attention/torch_backend.py); ``argmax_rows`` is the sampler's greedy
argmax. The C source is compiled on first use with the system C compiler (``$CC``, else ``cc``) and
``-O3 -march=native -fopenmp`` into the radixserve cache, keyed by the source, the flags and the
CPU's feature flags (a binary built for another CPU is never loaded). It links libgomp, which
resolves to the copy torch has already loaded, so kernel and torch share one OpenMP runtime.
Where it cannot be had (no x86-64 AVX-512, no compiler, the build fails) ``load()`` returns None
and says why once in the log; the backend then uses torch's flash op (partials.attend).

Measured against that op on this repository's bench shapes (alternating, median of 7, 2 threads,
fp32): 2.55x on a causal 256-query block over 1088 keys, 2.06x on a shared prefix read by 512
queries, 1.5-1.7x on decode reads of a shared prefix (ARCHITECTURE.md §3b).
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
from pathlib import Path

import torch

from radixserve.kernels.cache_dir import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MAX_HEAD_DIM = 128  # DMAX in the source; head_dim must also be a multiple of 32



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
        (("num_b", "num_h", "num_rows", "num_keys", "d", "group", "merge", "num_threads"), ctypes.c_int32),
        ("scale", ctypes.c_float),
    ] for name in ((names,) if isinstance(names, str) else names)]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _why_not(flags: str) -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs Linux on x86-64, not {platform.system()} on {platform.machine()}"
    if "avx512f" not in flags.split():
        return "the CPU has no AVX-512"
    if shutil.which(os.environ.get("CC", "cc")) is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH"
    return None


def _build(target: Path) -> None:
    """Compile into a temp file beside the target, then rename (concurrent builds never see half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [os.environ.get("CC", "cc"), *FLAGS, str(SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load():
    """The library (ctypes, entry points typed), or None where it cannot be built here (logged once)."""
    flags = _cpu_flags()
    reason = _why_not(flags)
    if reason is None:
        key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), flags.encode(),
                                         os.environ.get("CC", "cc").encode()])).hexdigest()[:16]
        target = Path(cache_root()) / "kernels" / f"cpu_kernels-{key}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = f"building it failed: {exc}"
        else:
            lib.rs_attend.argtypes, lib.rs_attend.restype = [ctypes.POINTER(_Args)], ctypes.c_int
            lib.rs_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_int]
            lib.rs_argmax_rows.restype = None
            return lib
    logger.info("native CPU kernels unavailable (%s); using torch's flash attention op", reason)
    return None


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the kernel can serve these K/V (and is built)."""
    return (device.type == "cpu" and dtype == torch.float32 and head_dim % 32 == 0
            and head_dim <= MAX_HEAD_DIM and load() is not None)


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None,
                 bounds: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [b, h, rows, d] over keys read in place from the pool: key j of entry b is
    slot ``slots[b, j]`` of k_cache / v_cache [slots, h, d] (slots None: slot j, for a view of a
    run of the pool). ``bounds`` = (lo, hi), int32 [b, rows] with the same strides: row r sees keys
    [lo, hi) (None: all; lo None: from 0).
    Returns (out [b, h, rows, d] float32, natural-log LSE [b, h, rows]); a row that sees no key
    gets out 0 and LSE -inf. Every tensor's last dimension must be contiguous; ``supports`` must hold."""
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
    lo, hi = bounds if bounds is not None else (None, None)
    for name, t in (("lo", lo), ("hi", hi), ("tokens", tokens), ("slots", slots)):
        if t is not None and t.stride(-1) != 1:  # the kernel steps through their rows one by one
            raise ValueError(f"native attention needs {name} contiguous along its last dimension")
    args = _Args(q.data_ptr(), *q_strides, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                 k_cache.stride(1), _ptr(slots), 0 if slots is None else slots.stride(0), _ptr(lo), _ptr(hi),
                 0 if hi is None else hi.stride(0), _ptr(tokens), 0 if tokens is None else tokens.stride(0),
                 out.data_ptr(), *o_strides, lse.data_ptr(), *l_strides,
                 num_b, num_h, rows, slots.shape[1] if slots is not None else k_cache.shape[0], q.shape[-1],
                 group, int(merge), torch.get_num_threads(), scale)
    if load().rs_attend(ctypes.byref(args)) != 0:
        raise ValueError(f"native attention refused head_dim {q.shape[-1]}, {rows} rows or group {group}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D tensor (same answer: the first max, the first NaN where a row has
    one); through the native library for float32 on the CPU with contiguous rows: torch's CPU
    argmax is a scalar loop (measured, 2 threads, 64 x 4096: 160 us, against 16 here)."""
    if (x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1
            or x.shape[1] == 0 or load() is None):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    load().rs_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out
