"""The matmul of quantized weights (quant.py's formats) on the native kernels, and which of them runs here.

The native kernels: cpu_quant.c on AMX tiles, cpu_quant_vec.c with AVX512-BF16 where there are no tiles
(``kernel()`` names the one that runs); fp32 sums, the output rounded to bf16 once. For up to 16 rows (decode) with groups of 32 or more it multiplies the integer values themselves (exact in bf16) and
scales each group's sums in fp32 (adding min times the group's input sum), so the weights are never rounded;
otherwise it rounds each dequantized weight to bf16 (nearest even) and equals the bf16 tile linear on
``dequantize(...).bfloat16()`` bit for bit. Without tiles, up to 16 rows take the same values-then-scale arithmetic
on vdpbf16ps; more rows a bf16 matmul (torch) over the weights dequantized to bf16 a column chunk at a time. fp32
activations, and bf16 ones where neither runs, take cpu_quant_f32.c (every build: AVX2-only CPUs too), fp32 sums
throughout. Only without the native library does ``linear`` dequantize per call and use F.linear (correct, slow).
Compact weights (two-level scales, symmetric int4) take cpu_quant_f32.c whatever the activations' dtype, and a weight
marked ``int8_activations`` takes up to quant_act.MAX_ROWS rows on cpu_quant_i8.c (``linear_int8``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import quant_act
from .quant import PackedQuant, QuantStack

DEQUANT_CHUNK_BYTES = 32 << 20  # a many-row linear without tiles dequantizes this many bytes at a time


def kernel(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """The native quantized kernel that runs here for activations in `dtype`: in bf16 "tiles" (AMX, cpu_quant.c)
    or "avx512-bf16" (cpu_quant_vec.c) where the CPU has them; else "fp32" (cpu_quant_f32.c, in every build of the
    library: fp32 activations, and bf16 ones on CPUs with neither); None without the library (linear dequantizes
    per call)."""
    from . import native

    if dtype == torch.bfloat16 and native.tiles_ready():
        return "tiles"
    if native.load() is None:
        return None
    return "avx512-bf16" if dtype == torch.bfloat16 and native._use_dpbf16() else "fp32"


def linear(x: torch.Tensor, w: "PackedQuant | QuantStack", bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T + bias, in x's dtype, on the native kernel (``kernel()``): x and bias rounded
    to bf16, fp32 sums, the output rounded to bf16 and cast to x's dtype (the module docstring says where weights
    are rounded to bf16). Elsewhere F.linear on weights dequantized for the call (correct, slow). A weight marked
    ``int8_activations`` takes up to quant_act.MAX_ROWS rows on cpu_quant_i8.c instead (``linear_int8``). A
    QuantStack multiplies each part and concatenates the outputs."""
    from . import native

    if isinstance(w, QuantStack):
        outs, start = [], 0
        for p in w.parts:  # each part's rows of the bias
            outs.append(linear(x, p, None if bias is None else bias[start:start + p.n]))
            start += p.n
        return torch.cat(outs, dim=1)
    path = kernel(x.dtype) if x.device.type == "cpu" else None
    if path is not None and w.compact:
        path = "fp32"  # the bf16 kernels (cpu_quant.c, cpu_quant_vec.c) take the expanded form only
    if path is None:
        return F.linear(x, w.unpack().dequantize().to(x.dtype), bias)
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"a quantized linear takes x [M, {w.k}], got {tuple(x.shape)}")
    if w.int8_activations and x.shape[0] <= quant_act.MAX_ROWS[w.kind]:
        return linear_int8(x, w, bias).to(x.dtype)
    if path == "fp32":
        return _linear_f32(x, w, bias).to(x.dtype)
    xb = x.to(torch.bfloat16).contiguous()
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
    if path != "tiles" and xb.shape[0] > 16:
        return _dequantized_matmul(xb, w, bias).to(x.dtype)
    out = torch.empty((xb.shape[0], w.n), dtype=torch.bfloat16)
    fn = native.load().rs_linear_quant if path == "tiles" else native.load().rs_quant_rows
    code = fn(xb.data_ptr(), xb.shape[0], w.flags, w.data.data_ptr(), w.scales.data_ptr(), _ptr(w.mins), w.n, w.k,
              w.group, _ptr(bias), out.data_ptr(), torch.get_num_threads())
    _accepted(code, "the quantized linear kernel", w)
    return out.to(x.dtype)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _accepted(code: int, what: str, w: PackedQuant) -> None:
    """RuntimeError naming the kernel and the weight where a native call returned nonzero."""
    if code != 0:
        raise RuntimeError(f"{what} refused [{w.n}, {w.k}] group {w.group} (code {code})")


def _chunk_cols(w: PackedQuant, element_bytes: int) -> int:
    """Columns a many-row linear dequantizes at a time: DEQUANT_CHUNK_BYTES of weights, whole 16-column blocks."""
    return max(16, min(w.n, DEQUANT_CHUNK_BYTES // (element_bytes * w.k)) // 16 * 16)


def _rows(fn: Callable[..., int], what: str, x: torch.Tensor, w: PackedQuant,
          bias: torch.Tensor | None) -> torch.Tensor:
    """Up to 16 rows of x on a row kernel of the packed weights in fp32 (rs_quant_rows_f32, rs_quant_rows_i8)."""
    xf = x.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty((xf.shape[0], w.n), dtype=torch.float32)
    code = fn(xf.data_ptr(), xf.shape[0], w.flags, w.data.data_ptr(), w.scales.data_ptr(), _ptr(w.mins), w.n, w.k,
              w.group, _ptr(bias), out.data_ptr(), torch.get_num_threads())
    _accepted(code, what, w)
    return out


def linear_int8(x: torch.Tensor, w: PackedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """quant_act.quantize_activations(x) [M <= 16, K] @ dequantize(w)^T + bias in fp32, on cpu_quant_i8.c (where
    quant_act.ready())."""
    from . import native

    return _rows(native.load().rs_quant_rows_i8, "the int8-activation quantized kernel", x, w, bias)


def _linear_f32(x: torch.Tensor, w: PackedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """cpu_quant_f32.c: up to 16 rows on the packed weights; more, per chunk of columns the weights dequantized to
    fp32 ([cols, K]) and one fp32 matmul."""
    from . import native

    lib, threads = native.load(), torch.get_num_threads()
    if x.shape[0] <= 16:
        return _rows(lib.rs_quant_rows_f32, "the fp32 quantized kernel", x, w, bias)
    xf = x.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty((xf.shape[0], w.n), dtype=torch.float32)
    cols = _chunk_cols(w, 4)
    part = torch.empty((cols, w.k), dtype=torch.float32)
    for n0 in range(0, w.n, cols):
        n1 = min(w.n, n0 + cols)
        code = lib.rs_quant_dequant_f32(w.flags, w.data.data_ptr(), w.scales.data_ptr(), _ptr(w.mins), w.n, w.k,
                                        w.group, n0, n1, part.data_ptr(), threads)
        _accepted(code, "the fp32 dequantizing kernel", w)
        out[:, n0:n1] = F.linear(xf, part[:n1 - n0], None if bias is None else bias[n0:n1])
    return out


def _dequantized_matmul(xb: torch.Tensor, w: PackedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """Many rows without tiles: per chunk of columns, the weights dequantized to bf16 (transposed, [K, cols],
    cpu_quant_vec.c) and one bf16 matmul."""
    from . import native

    out = torch.empty((xb.shape[0], w.n), dtype=torch.bfloat16)
    cols = _chunk_cols(w, 2)
    wt = torch.empty((w.k, cols), dtype=torch.bfloat16)
    for n0 in range(0, w.n, cols):
        n1 = min(w.n, n0 + cols)
        part = wt if n1 - n0 == cols else torch.empty((w.k, n1 - n0), dtype=torch.bfloat16)
        code = native.load().rs_quant_dequant_t(w.flags, w.data.data_ptr(), w.scales.data_ptr(), _ptr(w.mins), w.n,
                                                w.k, w.group, n0, n1, part.data_ptr(), torch.get_num_threads())
        _accepted(code, "the dequantizing kernel", w)
        out[:, n0:n1] = xb @ part if bias is None else torch.addmm(bias[n0:n1], xb, part)
    return out
