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

Dequantization, defined once here and matched bit for bit by the kernel: int8 fp32(q) * scale (one fp32
rounding); int4 fma(q, scale, min) (one rounding). The native kernel (cpu_quant.c) rounds each dequantized
weight to bf16 (round to nearest even) and runs the bf16 tile product, fp32 sums, so its result equals the bf16
tile linear on ``dequantize(...).bfloat16()`` weights. Where the native kernel cannot run, ``linear``
dequantizes per call and uses F.linear (correct, slow).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("int8", "int4")
CHOICES = ("int8", "int8-g32", "int4", "int4-g128")  # --quantization: int8 per output channel, int4 group 32
INT4_GROUPS = (32, 128)


@dataclass(frozen=True)
class QuantSpec:
    """What --quantization asks for: the format and its group along K (None: one group per row, g = K)."""

    kind: str
    group: int | None

    def group_for(self, k: int) -> int:
        return k if self.group is None else self.group


def parse_quantization(name: str | None) -> QuantSpec | None:
    """--quantization's value: None / "none" (float weights), or one of CHOICES. ValueError otherwise."""
    if name is None or name == "none":
        return None
    if name not in CHOICES:
        raise ValueError(f"quantization must be one of none, {', '.join(CHOICES)}; got {name!r}")
    kind, _, group = name.partition("-g")
    return QuantSpec(kind, int(group) if group else (None if kind == "int8" else 32))


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


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    check_group(k, group)
    return w.float().reshape(n, k // group, group)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantWeight:
    """Symmetric int8 of a float [N, K] weight: per group of `group` inputs (None: per output channel) scale =
    max |w| / 127, q = round(w / scale)."""
    group = group or w.shape[1]
    g = _groups(w, group)
    scales = g.abs().amax(dim=2) / 127.0
    q = torch.round(g / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(-127, 127)
    return QuantWeight("int8", q.to(torch.int8).reshape(w.shape), scales.contiguous(), None, group)


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantWeight:
    """Affine int4 of a float [N, K] weight: per group min = min w, scale = (max w - min) / 15,
    q = round((w - min) / scale)."""
    g = _groups(w, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = (hi - lo) / 15.0
    q = torch.round((g - lo[..., None]) / torch.where(scales > 0, scales, 1.0)[..., None]).clamp_(0, 15)
    return QuantWeight("int4", q.to(torch.uint8).reshape(w.shape), scales.contiguous(), lo.contiguous(), group)


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
    """x [M, K] @ dequantize(w)^T + bias, in x's dtype. The native kernel (bf16 activations; float32 ones are
    rounded to bf16 and the output cast back) where it runs, else F.linear on weights dequantized for the call."""
    from . import native

    if native.quant_supported(x):
        out = native.linear_quant(x.to(torch.bfloat16), w, None if bias is None else bias.to(torch.bfloat16))
        return out.to(x.dtype)
    return F.linear(x, w.unpack().dequantize().to(x.dtype), bias)
