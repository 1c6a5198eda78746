"""Weight-only quantized linears: the two weight formats, their packing for the native kernels, quantizing a float
checkpoint's weights into them (the matmul: quant_linear.py).

Two formats, each a lossless target for the block types of GGUF files (kernels' GGUF reader maps onto them):

- **int8**: w[n, k] = scale[n, k // g] * q[n, k], q int8 (-128..127), one scale per group of g inputs along K;
  g = K is one scale per output channel. Covers Q8_0 (g 32), Q6_K (6-bit values, g 16; d * sub-scale is the
  group's scale), Q5_0 (g 32, q - 16).
- **int4** (affine): w[n, k] = scale[n, k // g] * q[n, k] + min[n, k // g], q 0..15, a scale and a min per group
  (g 32, or 128). Covers Q4_0 (min = -8 * scale), Q4_1 (its m is min) and Q4_K (per-32 sub-block:
  scale = d * sc, min = -dmin * m).

Scales and mins are fp16 where that is exact (GGUF's Q8_0 / Q5_0 / Q4_0 / Q4_1 store fp16 scales; the quantizers
here round their scale up and min down to fp16 and quantize against those), else fp32 (a scale past fp16's range).
At group 32 fp16 scales cost 0.5 bit per weight (int4: 1 with its mins), fp32 twice that: Q4_0 (4.5 bits) kept as
int4 takes 5 bits per weight, not 6. Two compact forms keep GGUF files' bytes (``QuantWeight.expanded`` is the plain
form they stand for): Q4_K and Q6_K's two levels (quant_levels.py: an fp16 factor per 256 inputs times int8
sub-scales, whose products are the scales), and symmetric int4 (Q4_0: no mins, each -8 times its scale; 4.5 bits
per weight). Only cpu_quant_f32.c and cpu_quant_i8.c read them: ``quant_linear.linear`` takes them there whatever the
activations' dtype, and the GGUF loader expands them where the bf16 kernels would run. A fused linear whose parts
differ in format is a ``QuantStack``. The unpacked form is
``QuantWeight``: values [N, K] one per byte, scales / mins [N, K / g]. It is what ``quantize_int8`` /
``quantize_int4`` (from a float tensor) and a GGUF mapping produce, what the loader concatenates
(q / k / v, gate / up) and reorders (rotary pairs) row-wise, and what ``pack`` turns into the kernel's layout:

- ``PackedQuant.data``: the values in the AMX tile order of ``native.pack_tiles``, [N / 16][K / 32][16 input
  pairs][16 columns][2]; int8 one byte each, int4 two per byte (byte j of row r of a 32-input block holds
  element j of pair row 2r in its low nibble and of pair row 2r + 1 in its high nibble).
- ``PackedQuant.scales`` / ``mins``: [N / 16][K / g][16], a column block's 16 scales of a group together.

Dequantization, defined once here (scales widened to fp32, exact): int8 fp32(q) * scale (one fp32 rounding); int4
fma(q, scale, min) (one rounding). ``PackedQuant.lookup`` dequantizes only the rows it gathers: an embedding table
kept quantized (a GGUF file's), whose tied LM head is the same PackedQuant. The matmul on the native kernels is
quant_linear.py's.
"""
from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch

from . import quant_levels as levels
from .quant_spec import QuantSpec

logger = logging.getLogger(__name__)
KINDS = ("int8", "int4")
SCALE_DTYPES = (torch.float16, torch.float32)
LINEAR_WEIGHT = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$|^lm_head\.weight$")


def check_group(k: int, group: int) -> None:
    """ValueError unless groups of `group` inputs tile a row of `k`: group a multiple of 16 dividing k."""
    if group <= 0 or group % 16 or k % group:
        raise ValueError(f"quantization group {group} must be a positive multiple of 16 that divides K = {k}")


@dataclass
class QuantWeight:
    """A quantized [N, K] weight, unpacked (the module docstring): q int8 (int8) or uint8 0..15 (int4). Two compact
    forms, which only the fp32 kernels read: with ``super_scales`` the scales (and mins) are two-level
    (quant_levels.py: int8 sub-scales times fp16 factors); an int4 weight without mins is symmetric (each group's
    min is -8 times its scale: GGUF's Q4_0, 0.5 bit per weight less)."""

    kind: str
    q: torch.Tensor  # [N, K]
    scales: torch.Tensor  # [N, K / group] float16 or float32 (two-level: int8)
    mins: torch.Tensor | None  # [N, K / group] scales' dtype (int4), None (int8, symmetric int4)
    group: int
    super_scales: torch.Tensor | None = None  # two-level: [N, K / SUPER] float16
    super_mins: torch.Tensor | None = None  # two-level int4 with mins: [N, K / SUPER] float16

    def __post_init__(self) -> None:
        n, k = self.q.shape
        check_group(k, self.group)
        want = (torch.int8, None) if self.kind == "int8" else (torch.uint8, torch.float32)
        if self.kind not in KINDS or self.q.dtype != want[0]:
            raise ValueError(f"{self.kind} weights need values of dtype {want[0]}, got {self.kind} / {self.q.dtype}")
        two, has_mins = self.two_level, self.mins is not None
        if two:
            levels.check(k, self.group)
        present = {"mins": has_mins and self.kind == "int4", "super_scales": two, "super_mins": two and has_mins}
        for name, t, cols in (("scales", self.scales, k // self.group), ("mins", self.mins, k // self.group),
                              ("super_scales", self.super_scales, k // levels.SUPER),
                              ("super_mins", self.super_mins, k // levels.SUPER)):
            if (t is not None) != present.get(name, True):
                raise ValueError(f"{self.kind} weights {'take no' if t is not None else 'need'} {name}")
            allowed = (torch.float16,) if name.startswith("super") else (torch.int8,) if two else SCALE_DTYPES
            if t is not None and (t.dtype not in allowed or (name == "mins" and t.dtype != self.scales.dtype)
                                  or tuple(t.shape) != (n, cols)):
                raise ValueError(f"{name} must be {' or '.join(str(d)[6:] for d in allowed)} [{n}, {cols}], got "
                                 f"{t.dtype} {tuple(t.shape)}")
        if self.kind == "int4" and self.q.numel() and int(self.q.max()) > 15:
            raise ValueError("int4 values must lie in 0..15")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        """The bytes it takes packed (PackedQuant.nbytes): int4 values two to a byte, the scale tables as they are."""
        tables = (self.scales, self.mins, self.super_scales, self.super_mins)
        return self.q.numel() // (2 if self.kind == "int4" else 1) + sum(
            t.numel() * t.element_size() for t in tables if t is not None)

    @property
    def two_level(self) -> bool:
        return self.super_scales is not None

    @property
    def symmetric(self) -> bool:
        return self.kind == "int4" and self.mins is None

    @property
    def format(self) -> tuple[str, int, bool, bool]:
        """What weights must share to be concatenated into one: kind, group, the compact forms."""
        return self.kind, self.group, self.two_level, self.symmetric

    def expanded(self) -> "QuantWeight":
        """The same weight in the form every kernel reads: one scale and (int4) one min per group, two-level ones'
        exact float32 products, a symmetric weight's mins -8 times its scales (in fp16 where that stays finite)."""
        if not (self.two_level or self.symmetric):
            return self
        if self.two_level:
            mins = None if self.mins is None else levels.product(self.super_mins, self.mins, self.group)
            scales = levels.product(self.super_scales, self.scales, self.group)
        else:
            scales, mins = self.scales, None
        if self.kind == "int4" and mins is None:
            mins = scales * -8
            if not bool(torch.isfinite(mins).all()):
                scales, mins = scales.float(), scales.float() * -8
        return QuantWeight(self.kind, self.q, scales, mins, self.group)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weights this stands for (the definition the kernel matches)."""
        w = self.expanded()
        return dequantize_values(w.q, w.scales, w.mins, w.group)

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        """The weight with its rows reordered / selected (rows are independent in every format)."""
        pick = lambda t: None if t is None else t[index].contiguous()  # noqa: E731
        return QuantWeight(self.kind, pick(self.q), pick(self.scales), pick(self.mins), self.group,
                           pick(self.super_scales), pick(self.super_mins))

    @staticmethod
    def cat(parts: "list[QuantWeight]") -> "QuantWeight":
        """Row-wise concatenation (fused q / k / v, gate / up) of weights of one format."""
        first = parts[0]
        if any(p.format != first.format for p in parts):
            raise ValueError("only quantized weights of one kind, group and scale levels concatenate")
        cat = lambda name: None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return QuantWeight(first.kind, cat("q"), cat("scales"), cat("mins"), first.group, cat("super_scales"),
                           cat("super_mins"))


def dequantize_values(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int) -> torch.Tensor:
    """float32 weights of values q [n, K] and their scales (and mins) [n, K / group] (the formats' definition)."""
    scales = scales.float().repeat_interleave(group, dim=1)
    if mins is None:
        return q.float() * scales
    mins = mins.float().repeat_interleave(group, dim=1)
    return (q.double() * scales.double() + mins.double()).float()  # exact product: one rounding, an fma


def _half(t: torch.Tensor, up: bool) -> torch.Tensor:
    """t rounded to fp16 upward (`up`) or downward (never toward the other side of t)."""
    h = t.half()
    off = h.float() < t if up else h.float() > t
    return torch.where(off, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)


CHUNK_ELEMENTS = 1 << 22  # a quantizer's float32 temporaries cover this many weights at a time (16 MB each)


def _by_rows(w: torch.Tensor, group: int, quantize_rows: Callable[[torch.Tensor], tuple]) -> tuple:
    """quantize_rows(float32 [rows, K / group, group]) over blocks of rows, its results concatenated: the float
    temporaries stay a few MB whatever the tensor (an 8B model's embedding would take GBs at once)."""
    n, k = w.shape
    check_group(k, group)
    rows = max(1, CHUNK_ELEMENTS // k)
    parts = [quantize_rows(w[i:i + rows].float().reshape(-1, k // group, group)) for i in range(0, n, rows)]
    if any(p[1].dtype == torch.float32 for p in parts):  # one dtype per weight (fp16 widens exactly)
        parts = [tuple(t if t is None or t.dtype == torch.int8 or t.dtype == torch.uint8 else t.float() for t in p)
                 for p in parts]
    return tuple(torch.cat(p) if p[0] is not None else None for p in zip(*parts))


def _compact(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> QuantWeight:
    """Symmetric int8 of a float [N, K] weight: per group of `group` inputs (None: per output channel) scale =
    max |w| / 127 rounded up to fp16 (fp32 past its range), q = round(w / scale)."""
    group = group or w.shape[1]

    def rows(g: torch.Tensor) -> tuple:
        scales = g.abs().amax(dim=2) / 127.0
        if _compact(half := _half(scales, up=True)):
            scales = half
        s32 = scales.float()
        q = torch.round(g / torch.where(s32 > 0, s32, 1.0)[..., None]).clamp_(-127, 127)
        return q.to(torch.int8).flatten(1), scales

    q, scales = _by_rows(w, group, rows)
    return QuantWeight("int8", q, scales, None, group)


def quantize_int4(w: torch.Tensor, group: int = 32) -> QuantWeight:
    """Affine int4 of a float [N, K] weight: per group min = min w (rounded down to fp16), scale =
    (max w - min) / 15 (rounded up to fp16; both fp32 past its range), q = round((w - min) / scale)."""
    def rows(g: torch.Tensor) -> tuple:
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        if _compact(lo16 := _half(lo, up=False)) and _compact(s16 := _half((hi - lo16.float()) / 15.0, up=True)):
            lo, scales = lo16, s16
        else:
            scales = (hi - lo) / 15.0
        s32 = scales.float()
        q = torch.round((g - lo.float()[..., None]) / torch.where(s32 > 0, s32, 1.0)[..., None]).clamp_(0, 15)
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
    scales: torch.Tensor  # [N/16, K/group, 16] float16 or float32; two-level: uint8 quant_levels.blob
    mins: torch.Tensor | None
    int8_activations: bool = False  # decode rows quantized to int8 (quant_act.py; the runner sets it)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def two_level(self) -> bool:
        return self.scales.dtype == torch.uint8

    @property
    def symmetric(self) -> bool:
        return self.kind == "int4" and self.mins is None

    @property
    def compact(self) -> bool:
        """In a form only cpu_quant_f32.c and cpu_quant_i8.c read (two-level scales, symmetric int4)."""
        return self.two_level or self.symmetric

    @property
    def flags(self) -> int:
        """The kernels' format flags (cpu_qview.h): 1 int4 (else int8), 2 fp16 scales and mins (else fp32), 4
        two-level scales and mins (quant_levels.py), 8 symmetric int4 (no mins)."""
        return (int(self.kind == "int4") | 2 * int(self.scales.dtype == torch.float16) | 4 * int(self.two_level)
                | 8 * int(self.symmetric))

    def _group_scales(self, t: torch.Tensor | None, blk: torch.Tensor, col: torch.Tensor) -> torch.Tensor | None:
        """The per-group scales (or mins) [n, K / group] of columns blk * 16 + col (one level)."""
        if t is None or not self.two_level:
            return None if t is None else t[blk, :, col]
        factors, sub = levels.split(t[blk], self.group)  # only the blocks gathered
        picked = torch.arange(len(blk))
        return levels.product(factors[picked, :, col], sub[picked, :, col], self.group)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight, in `dtype` (an embedding lookup: only those rows dequantized)."""
        ids = ids.reshape(-1).to(torch.int64)
        blk, col = ids // 16, ids % 16
        if self.kind == "int8":  # [n, K/32, 16 pair rows, 2]
            q = self.data.view(self.n // 16, self.k // 32, 16, 16, 2)[blk, :, :, col]
        else:  # bytes [n, K/32, 8, 2]: low nibbles pair row 2r, high 2r + 1
            raw = self.data.view(self.n // 16, self.k // 32, 8, 16, 2)[blk, :, :, col]
            q = torch.stack((raw & 15, raw >> 4), dim=3)
        scales, mins = self._group_scales(self.scales, blk, col), self._group_scales(self.mins, blk, col)
        if self.symmetric:
            mins = scales.float() * -8
        w = dequantize_values(q.reshape(len(ids), self.k), scales, mins, self.group)
        return w.to(dtype)

    def unpack(self) -> QuantWeight:
        """The QuantWeight this was packed from (exact)."""
        tiles = self.data
        if self.kind == "int4":
            raw = self.data
            tiles = torch.stack((raw & 15, raw >> 4), dim=3).reshape(*raw.shape[:2], 16, 32)
        q = tiles.reshape(self.n // 16, self.k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(self.n, self.k)
        cols = lambda t: None if t is None else t.permute(0, 2, 1).reshape(self.n, -1).contiguous()  # noqa: E731
        if not self.two_level:
            return QuantWeight(self.kind, q.contiguous(), cols(self.scales), cols(self.mins), self.group)
        (fs, ss), (fm, sm) = (levels.split(t, self.group) if t is not None else (None, None)
                              for t in (self.scales, self.mins))
        return QuantWeight(self.kind, q.contiguous(), cols(ss), cols(sm), self.group, cols(fs), cols(fm))


@dataclass
class QuantStack:
    """The weight of a fused linear (q / k / v, gate / up) whose parts are in different formats, e.g. a Q4_K_M file's
    Q6_K v (int8, group 16) beside Q4_K q / k (int4, group 32): each run of parts in one format packed on its own
    (``cat_rows``), ``linear`` puts their outputs side by side. The parts stay quantized rather than all of them
    dequantized to the engine's dtype."""

    parts: tuple[PackedQuant, ...]

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def packed_parts(w: "PackedQuant | QuantStack | None") -> tuple[PackedQuant, ...]:
    """The PackedQuants a layer's quantized weight multiplies (none, one, or a stack's)."""
    return () if w is None else w.parts if isinstance(w, QuantStack) else (w,)


def packed(weight: "QuantWeight | list[QuantWeight] | PackedQuant") -> "PackedQuant | QuantStack":
    """What a layer multiplies: a QuantWeight packed, cat_rows' list as a QuantStack, a PackedQuant as it is (a
    quantized tied table)."""
    if isinstance(weight, QuantWeight):
        return pack(weight)
    return QuantStack(tuple(pack(p) for p in weight)) if isinstance(weight, list) else weight


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
    """w in the kernel's layout (module docstring); N must be a multiple of 16, K of 32. Packed in row blocks
    of about CHUNK_ELEMENTS weights (the reordering's temporaries stay small beside an 8B model's embedding)."""
    n, k = w.shape
    _tile_order(w.q[:0])  # the shape check
    data = torch.empty((n // 16, k // 32, 16 if w.kind == "int8" else 8, 32), dtype=w.q.dtype)
    step = max(16, CHUNK_ELEMENTS // k // 16 * 16)
    for i in range(0, n, step):
        tiles = _tile_order(w.q[i:i + step])
        data[i // 16:(i + step) // 16] = tiles if w.kind == "int8" else tiles[:, :, 0::2] | (tiles[:, :, 1::2] << 4)
    if w.two_level:
        scales, mins = (None if sub is None else levels.blob(_block_cols(f), _block_cols(sub), w.group)
                        for f, sub in ((w.super_scales, w.scales), (w.super_mins, w.mins)))
    else:
        scales, mins = _block_cols(w.scales), None if w.mins is None else _block_cols(w.mins)
    return PackedQuant(w.kind, n, k, w.group, data, scales, mins)


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


def cat_rows(parts: list[torch.Tensor | QuantWeight | None]) -> torch.Tensor | QuantWeight | list[QuantWeight]:
    """Row-wise concatenation of fused projections' weights (q / k / v, gate / up): quantized where every part is,
    one QuantWeight where they share a format (QuantWeight.format), else a list of one QuantWeight per run of parts in
    one format (a QuantStack once packed); float where any part is (every quantized part dequantized)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        stacked = [QuantWeight.cat(list(run)) for _, run in itertools.groupby(parts, key=lambda p: p.format)]
        return stacked[0] if len(stacked) == 1 else stacked
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    return torch.cat([p.dequantize().to(dtype) if isinstance(p, QuantWeight) else p for p in parts])


def linear_weight(w: torch.Tensor | QuantWeight | list[QuantWeight],
                  dtype: torch.dtype) -> torch.Tensor | QuantWeight | list[QuantWeight]:
    """What layers.Linear gets: quantized weights (one, or cat_rows' list) whose shapes pack, else a float tensor in
    `dtype` (a list whose parts do not all pack dequantized whole)."""
    parts = w if isinstance(w, list) else [w]
    if not isinstance(parts[0], QuantWeight) or all(packable(p.shape) for p in parts):
        return w
    shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
    logger.warning("a quantized weight of shape %s does not pack (N a multiple of 16, K of 32): dequantized to %s",
                   shape, dtype)
    return torch.cat([p.dequantize().to(dtype) for p in parts])
