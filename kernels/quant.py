"""Weight-only quantized linears: the two weight formats, their packing for the native kernel, and the matmul.

Two formats, each a lossless target for the block types of GGUF files (kernels' GGUF reader maps onto them):

- **int8**: w[n, k] = scale[n, k // g] * q[n, k], q int8 (-128..127), one fp32 scale per group of g inputs along K;
  g = K is one scale per output channel. Covers Q8_0 (g 32), Q6_K (6-bit values, g 16; d * sub-scale is the
  group's scale), Q5_0 (g 32, q - 16).
- **int4** (affine): w[n, k] = scale[n, k // g] * q[n, k] + min[n, k // g], q 0..15, fp32 scale and min per group
  (g 32, or 128). Covers Q4_0 (min = -8 * scale), Q4_1 (its m is min) and Q4_K (per-32 sub-block:
  scale = d * sc, min = -dmin * m).

Scales and mins are fp32: GGUF's fp16 scales and Q4_K's products of an fp16 and a 6-bit integer are exact in fp32
(not in bf16). The unpacked form is ``QuantWeight``: values [N, K] one per byte, scales / mins [N, K / g]. It is what
``quantize_int8`` / ``quantize_int4`` (from a float tensor) and a GGUF mapping produce, what the loader concatenates
(q / k / v, gate / up) and reorders (rotary pairs) row-wise, and what ``pack`` turns into the kernel's layout:

- ``PackedQuant.data``: the values in the AMX tile order of ``native.pack_tiles``, [N / 16][K / 32][16 input
  pairs][16 columns][2]; int8 one byte each, int4 two per byte (byte j of row r of a 32-input block holds
  element j of pair row 2r in its low nibble and of pair row 2r + 1 in its high nibble).
- ``PackedQuant.scales`` / ``mins``: [N / 16][K / g][16] fp32, a column block's 16 scales of a group together.

Dequantization, defined once here: int8 fp32(q) * scale (one fp32 rounding); int4 fma(q, scale, min) (one
rounding). The native kernel (cpu_quant.c) runs on AMX tiles, fp32 sums, the output rounded to bf16 once. For up
to 16 rows (decode) with groups of 32 or more it multiplies the integer values themselves (exact in bf16) and
scales each group's sums in fp32 (adding min times the group's input sum), so the weights are never rounded;
otherwise it rounds each dequantized weight to bf16 (nearest even) and equals the bf16 tile linear on
``dequantize(...).bfloat16()`` bit for bit. Where tiles cannot run, ``linear`` dequantizes per call and uses
F.linear (correct, slow).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .quant_spec import QuantSpec

logger = logging.getLogger(__name__)
KINDS = ("int8", "int4")
LINEAR_WEIGHT = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$|^lm_head\.weight$")


def check_group(k: int, group: int) -> None:
    """ValueError unless groups of `group` inputs tile a row of `k`: group a multiple of 16 dividing k."""
    if group <= 0 or group % 16 or k % group:
        raise ValueError(f"quantization group {group} must be a positive multiple of 16 that divides K = {k}")


@dataclass
class QuantWeight:
    """A quantized [N, K] weight, unpacked (the module docstring): q int8 (int8) or uint8 0..15 (int4)."""

    kind: str
    q: torch.Tensor  # [N, K]
    scales: torch.Tensor  # [N, K / group] float32
    mins: torch.Tensor | None  # [N, K / group] float32 (int4), None (int8)
    group: int

    def __post_init__(self) -> None:
        n, k = self.q.shape
        check_group(k, self.group)
        want = (torch.int8, None) if self.kind == "int8" else (torch.uint8, torch.float32)
        if self.kind not in KINDS or self.q.dtype != want[0]:
            raise ValueError(f"{self.kind} weights need values of dtype {want[0]}, got {self.kind} / {self.q.dtype}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if (t is None) != (name == "mins" and self.kind == "int8"):
                raise ValueError(f"{self.kind} weights {'take no' if t is not None else 'need'} {name}")
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, k // self.group)):
                raise ValueError(f"{name} must be float32 [{n}, {k // self.group}], got {t.dtype} {tuple(t.shape)}")
        if self.kind == "int4" and self.q.numel() and int(self.q.max()) > 15:
            raise ValueError("int4 values must lie in 0..15")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weights this stands for (the definition the kernel matches)."""
        scales = self.scales.repeat_interleave(self.group, dim=1)
        if self.kind == "int8":
            return self.q.float() * scales
        mins = self.mins.repeat_interleave(self.group, dim=1)
        return (self.q.double() * scales.double() + mins.double()).float()  # exact product: one rounding, an fma

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        """The weight with its rows reordered / selected (rows are independent in every format)."""
        pick = lambda t: None if t is None else t[index].contiguous()  # noqa: E731
        return QuantWeight(self.kind, pick(self.q), pick(self.scales), pick(self.mins), self.group)

    @staticmethod
    def cat(parts: "list[QuantWeight]") -> "QuantWeight":
        """Row-wise concatenation (fused q / k / v, gate / up) of weights of one kind and group."""
        first = parts[0]
        if any(p.kind != first.kind or p.group != first.group for p in parts):
            raise ValueError("only quantized weights of one kind and group concatenate")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        return QuantWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), mins,
                           first.group)


CHUNK_ELEMENTS = 1 << 22  # a quantizer's float32 temporaries cover this many weights at a time (16 MB each)


def _by_rows(w: torch.Tensor, group: int, quantize_rows: Callable[[torch.Tensor], tuple]) -> tuple:
    """quantize_rows(float32 [rows, K / group, group]) over blocks of rows, its results concatenated: the float
    temporaries stay a few MB whatever the tensor (an 8B model's embedding would take GBs at once)."""
    n, k = w.shape
    check_group(k, group)
    rows = max(1, CHUNK_ELEMENTS // k)
    parts = [quantize_rows(w[i:i + rows].float().reshape(-1, k // group, group)) for i in range(0, n, rows)]
    return tuple(torch.cat(p) if p[0] is not None else None for p in zip(*parts))


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantWeight:
    """Symmetric int8 of a float [N, K] weight: per group of `group` inputs (None: per output channel) scale =
    max |w| / 127, q = round(w / scale)."""
    group = group or w.shape[1]

    def rows(g: torch.Tensor) -> tuple:
        scales = g.abs().amax(dim=2) / 127.0
        q = torch.round(g / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(-127, 127)
        return q.to(torch.int8).flatten(1), scales

    q, scales = _by_rows(w, group, rows)
    return QuantWeight("int8", q, scales, None, group)


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantWeight:
    """Affine int4 of a float [N, K] weight: per group min = min w, scale = (max w - min) / 15,
    q = round((w - min) / scale)."""
    def rows(g: torch.Tensor) -> tuple:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scales = (hi - lo) / 15.0
        q = torch.round((g - lo[..., None]) / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(0, 15)
        return q.to(torch.uint8).flatten(1), scales, lo

    q, scales, mins = _by_rows(w, group, rows)
    return QuantWeight("int4", q, scales, mins, group)


@dataclass
class PackedQuant:
    """A QuantWeight in the native kernel's layout (module docstring)."""

    kind: str
    n: int
    k: int
    group: int
    data: torch.Tensor  # int8 [N/16, K/32, 16, 32] or uint8 [N/16, K/32, 8, 32]
    scales: torch.Tensor  # [N/16, K/group, 16] float32
    mins: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def unpack(self) -> QuantWeight:
        """The QuantWeight this was packed from (exact)."""
        tiles = self.data
        if self.kind == "int4":
            raw = self.data
            tiles = torch.stack((raw & 15, raw >> 4), dim=3).reshape(*raw.shape[:2], 16, 32)
        q = tiles.reshape(self.n // 16, self.k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(self.n, self.k)
        cols = lambda t: None if t is None else t.permute(0, 2, 1).reshape(self.n, -1).contiguous()  # noqa: E731
        return QuantWeight(self.kind, q.contiguous(), cols(self.scales), cols(self.mins), self.group)


def packable(shape: tuple[int, int] | torch.Size) -> bool:
    """Whether a weight of this [N, K] shape packs: N a multiple of 16 and K of 32 (the tile shape)."""
    return shape[0] % 16 == 0 and shape[1] % 32 == 0


def _tile_order(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    if not packable(q.shape):
        raise ValueError(f"a packed quantized weight needs N a multiple of 16 and K of 32, got [{n}, {k}]")
    return q.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)


def _block_cols(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0] // 16, 16, t.shape[1]).permute(0, 2, 1).contiguous()


def pack_int8(values: torch.Tensor, scales: torch.Tensor, group: int) -> PackedQuant:
    """Pack int8 values [N, K] with float32 scales [N, K / group] (validated as a QuantWeight)."""
    return pack(QuantWeight("int8", values, scales, None, group))


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int) -> PackedQuant:
    """Pack int4 values (uint8 0..15) [N, K] with float32 scales and mins [N, K / group]."""
    return pack(QuantWeight("int4", q, scales, mins, group))


def pack(w: QuantWeight) -> PackedQuant:
    """w in the kernel's layout (module docstring); N must be a multiple of 16, K of 32."""
    tiles = _tile_order(w.q)
    if w.kind == "int4":
        tiles = tiles[:, :, 0::2] | (tiles[:, :, 1::2] << 4)
    n, k = w.shape
    mins = None if w.mins is None else _block_cols(w.mins)
    return PackedQuant(w.kind, n, k, w.group, tiles.contiguous(), _block_cols(w.scales), mins)


def linear(x: torch.Tensor, w: PackedQuant, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ dequantize(w)^T + bias, in x's dtype. On AMX tiles (cpu_quant.c) where they run: x and bias
    rounded to bf16, each weight rounded to bf16 once dequantized, fp32 sums, the output rounded to bf16 and cast
    to x's dtype. Elsewhere F.linear on weights dequantized for the call (correct, slow)."""
    from . import native

    if x.device.type != "cpu" or not native.tiles_ready():
        return F.linear(x, w.unpack().dequantize().to(x.dtype), bias)
    xb = x.to(torch.bfloat16).contiguous()
    if xb.dim() != 2 or xb.shape[1] != w.k:
        raise ValueError(f"a quantized linear takes x [M, {w.k}], got {tuple(x.shape)}")
    bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
    out = torch.empty((xb.shape[0], w.n), dtype=torch.bfloat16)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    code = native.load().rs_linear_quant(xb.data_ptr(), xb.shape[0], int(w.kind == "int4"), w.data.data_ptr(),
                                         w.scales.data_ptr(), ptr(w.mins), w.n, w.k, w.group, ptr(bias),
                                         out.data_ptr(), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"the quantized linear kernel refused [{w.n}, {w.k}] group {w.group} (code {code})")
    return out.to(x.dtype)


def quantize(w: torch.Tensor, spec: QuantSpec) -> QuantWeight:
    """A float [N, K] weight in the format and group `spec` names."""
    group = spec.group_for(w.shape[1])
    return quantize_int8(w, group) if spec.kind == "int8" else quantize_int4(w, group)


def quantizable(shape: tuple[int, ...] | torch.Size, spec: QuantSpec) -> bool:
    """Whether a weight of this shape takes `spec`: 2-D, K a multiple of 32 and of the group."""
    return len(shape) == 2 and shape[1] % 32 == 0 and shape[1] % spec.group_for(shape[1]) == 0


def load_transform(spec: QuantSpec | None) -> Callable[[str, torch.Tensor], torch.Tensor | QuantWeight] | None:
    """What the loader applies to each checkpoint tensor as it is read (loader.load_state_dict): linear weights
    (LINEAR_WEIGHT) that take `spec` become QuantWeights, so no full-width copy of the model is ever held."""
    if spec is None:
        return None
    skipped: list[str] = []

    def transform(name: str, t: torch.Tensor) -> torch.Tensor | QuantWeight:
        if not LINEAR_WEIGHT.search(name):
            return t
        if quantizable(t.shape, spec):
            return quantize(t, spec)
        if not skipped:
            logger.warning("%s %s stays in float: --quantization needs K a multiple of 32 and of the group",
                           name, tuple(t.shape))
        skipped.append(name)
        return t
    return transform


def cat_rows(parts: list[torch.Tensor | QuantWeight | None]) -> torch.Tensor | QuantWeight:
    """Row-wise concatenation of fused projections' weights (q / k / v, gate / up): quantized where every part is
    (of one kind and group), else float (any quantized part dequantized)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantWeight.cat(parts)
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    return torch.cat([p.dequantize().to(dtype) if isinstance(p, QuantWeight) else p for p in parts])


def linear_weight(w: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor | QuantWeight:
    """What layers.Linear gets: a QuantWeight whose shape packs, else a float tensor in `dtype`."""
    if not isinstance(w, QuantWeight) or packable(w.shape):
        return w
    logger.warning("a quantized weight of shape %s does not pack (N a multiple of 16, K of 32): dequantized to %s",
                   tuple(w.shape), dtype)
    return w.dequantize().to(dtype)
