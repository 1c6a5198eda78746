"""The elementwise steps of a decoder layer between its matmuls (kernels/cpu_pointwise.c): a residual add fused
into RMSNorm, rotary in place, SwiGLU, one native call each where the native library is loaded and the activations
are CPU bf16; torch ops (layers.py) everywhere else. Same numerics as the torch ops,
rounding where they round: a decode step of a few rows then pays one call per step instead of about a dozen
torch dispatches (model L, batch 1: ~5 ms of a 30 ms step)."""
from __future__ import annotations

import ctypes

import torch

from . import native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_typed: set[int] = set()  # id()s of libraries whose entry points are typed


def _lib() -> ctypes.CDLL | None:
    lib = native.load()
    if lib is not None and id(lib) not in _typed:
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.rs_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32, i32]
        lib.rs_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i32, i32]
        lib.rs_silu_mul.argtypes = [ptr, ptr, i64, i64, i32, i32]
        for fn in (lib.rs_add_rms_norm, lib.rs_rotary, lib.rs_silu_mul):
            fn.restype = i32
        _typed.add(id(lib))
    return lib


def usable(x: torch.Tensor) -> bool:
    """Whether this forward's activations take the native calls: bf16 on the CPU. fp32 keeps torch's ops, bit for
    bit (the calls differ from them by a few fp32 ulps, which flipped a scripted model's exactly tied logits in
    tests/test_reasoning_budget.py; fp32 parity with transformers stays exact). The calls serve fp32 too (tested)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and _lib() is not None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given), then RMSNorm(x) * weight as a new tensor. x, delta: [rows, d] contiguous,
    x's dtype; weight [d] in x's dtype."""
    out = torch.empty_like(x)
    _lib().rs_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                           out.data_ptr(), x.shape[0], x.shape[1], eps, _DTYPES[x.dtype], torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates, in place, the first `heads` heads of every row of x ([rows, >= heads * head_dim], unit stride in
    its last dim, pair-interleaved head dims); cos, sin: [rows, head_dim / 2] contiguous in x's dtype."""
    _lib().rs_rotary(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                     _DTYPES[x.dtype], torch.get_num_threads())


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a contiguous [rows, 2 * inter] fused projection, as [rows, inter]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty((rows, inter))
    _lib().rs_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, _DTYPES[gate_up.dtype],
                       torch.get_num_threads())
    return out
