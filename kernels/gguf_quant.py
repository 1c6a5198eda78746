"""GGUF block tensors as kernels/quant.py's QuantWeight, without loss: the integers and the per-group scales (and
mins) the file stores, in the unpacked form the quantized linears take.

    Q8_0  int8 q,      group 32, scale d
    Q5_0  int8 q - 16, group 32, scale d
    Q6_K  int8 q - 32, group 16, scale d * sc (sc an int8 per 16 values)
    Q4_0  int4 q,      group 32, scale d, min -8 d
    Q4_1  int4 q,      group 32, scale d, min m
    Q4_K  int4 q,      group 32, scale d * sc, min -dmin * m (sc, m 6-bit per 32 values)

Every scale and min is exact in float32 (a float16 times an integer of at most 8 bits), and those of Q8_0, Q5_0,
Q4_1 and Q4_0 in float16 (the file's own fp16; -8 d is exact too, unless it overflows), so those keep fp16 scales
(HALF_SCALES: 1 bit per weight for scale and min). For the fp32 kernels (``compact``) Q6_K and Q4_K keep d (and
-dmin) and their integer sub-scales as two-level scales (TWO_LEVEL, quant_levels.py) and Q4_0 drops its mins
(symmetric int4: -8 d implied); for the bf16 kernels every type has one scale and min per group, K-quants' products
in fp32 (``compact=False``). The scales are read from
the blocks' bytes; so are Q8_0's and Q4_0 / Q4_1's integers (plain bytes and nibbles); the others' (high bits and
6-bit layouts) are recovered from the gguf package's float32 dequantization, q = (x - min) / scale rounded (exact:
x carries at most one rounding of a value whose q is an integer of 4-6 bits), so those layouts are decoded in one
place, the gguf package. The tests check every type's QuantWeight against the gguf package's dequantization.
"""
from __future__ import annotations

import numpy as np
import torch

from .quant import PackedQuant, QuantWeight, pack

# GGUF type -> (QuantWeight kind, group along K)
LOSSLESS = {"Q8_0": ("int8", 32), "Q5_0": ("int8", 32), "Q6_K": ("int8", 16), "Q4_0": ("int4", 32),
            "Q4_1": ("int4", 32), "Q4_K": ("int4", 32)}
HALF_SCALES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1")  # scales and mins exactly fp16
TWO_LEVEL = ("Q6_K", "Q4_K")  # scales (and mins) an fp16 factor per 256 values times integer sub-scales


def quant_weight(data: np.ndarray, qtype, block_elements: int = 1 << 20, compact: bool = True) -> QuantWeight:
    """The QuantWeight [rows, row length] of a 2-D GGUF block tensor of a LOSSLESS type (raw bytes [rows, bytes per
    row] as gguf_header.GGUFHeader.data gives them), converted a few rows at a time (about `block_elements` values:
    one block's float32 transient) into tensors of the whole weight. With `compact` (the fp32 kernels') a TWO_LEVEL
    type keeps its factors and sub-scales (quant_levels.py) and Q4_0 no mins (symmetric int4); else every type has
    one scale (and min) per group, as the bf16 kernels read them."""
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, row_len = data.shape[0], data.shape[1] // block_bytes * block
    fields = ("q", "scales", "mins", "super_scales", "super_mins")
    out: dict[str, torch.Tensor | None] = {}
    step = max(1, block_elements // row_len)
    for start in range(0, rows, step):
        part = _rows(np.asarray(data[start:start + step]), qtype, compact)
        if not out:
            out = {f: None if (t := getattr(part, f)) is None else torch.empty((rows, *t.shape[1:]), dtype=t.dtype)
                   for f in fields}
        if part.scales.dtype == torch.float32 and out["scales"].dtype == torch.float16:  # fp16 widens exactly
            out["scales"], out["mins"] = out["scales"].float(), None if out["mins"] is None else out["mins"].float()
        for f in fields:
            if out[f] is not None:
                out[f][start:start + step] = getattr(part, f)
    return QuantWeight(part.kind, out["q"], out["scales"], out["mins"], part.group, out["super_scales"],
                       out["super_mins"])


def packed_weight(data: np.ndarray, qtype, block_elements: int = 1 << 22, compact: bool = True) -> PackedQuant:
    """quant.pack(quant_weight(data, qtype, compact=compact)) made a block of rows (a multiple of 16, about `block_elements` values)
    at a time straight into the packed tensors: the unpacked values (a byte per weight) of one block exist at a time,
    not of the whole tensor (525 MB for an 8B model's embedding or head)."""
    from gguf import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, row_len, out = data.shape[0], data.shape[1] // block_bytes * block, None
    step = max(16, block_elements // row_len // 16 * 16)
    for start in range(0, rows, step):
        part = pack(quant_weight(data[start:start + step], qtype, compact=compact))
        if out is None:
            empty = lambda t: None if t is None else torch.empty((rows // 16, *t.shape[1:]), dtype=t.dtype)  # noqa: E731
            out = PackedQuant(part.kind, rows, part.k, part.group, empty(part.data), empty(part.scales),
                              empty(part.mins))
        if part.scales.dtype != out.scales.dtype:  # a block past fp16's range: fp32 for the whole weight
            out.scales, out.mins = out.scales.float(), None if out.mins is None else out.mins.float()
        blocks = slice(start // 16, start // 16 + part.n // 16)
        out.data[blocks], out.scales[blocks] = part.data, part.scales
        if out.mins is not None:
            out.mins[blocks] = part.mins
    return out


def _rows(data: np.ndarray, qtype, compact: bool) -> QuantWeight:
    """The QuantWeight of some rows of a block tensor: fp16 scales where the type's are exactly fp16 (HALF_SCALES),
    a TWO_LEVEL type's factors and sub-scales, Q4_0 symmetric (no mins); without `compact` its expanded form."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    kind, group = LOSSLESS[qtype.name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    levels = _levels(qtype.name, blocks)  # [blocks, 1] factors, [blocks, groups per block] sub-scales
    if levels is not None:
        scales, mins = (None if f is None else f.astype(np.float32) * sub for f, sub in (levels[:2], levels[2:]))
    else:
        scales, mins = _scales(qtype.name, blocks)  # [blocks, groups per block]
    scales, mins = scales.reshape(rows, -1), None if mins is None else mins.reshape(rows, -1)
    q = _direct_values(qtype.name, blocks)
    if q is None:  # from the gguf package's dequantization
        x = dequantize(data, qtype).reshape(rows, -1, group)
        shifted = x if mins is None else x - mins[..., None]
        q = np.rint(shifted / np.where(scales == 0, 1, scales)[..., None])
        lo, hi = (-128, 127) if kind == "int8" else (0, 15)
        if q.size and (q.min() < lo or q.max() > hi):
            raise ValueError(f"{qtype.name} values outside {lo}..{hi}: not a lossless {kind} mapping")
        q = q.astype(np.int8 if kind == "int8" else np.uint8)
    q = torch.from_numpy(q.reshape(rows, -1))
    tensor = lambda a, dtype: None if a is None else torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1), dtype))  # noqa: E731
    if levels is not None:
        factors, sub, min_factors, min_sub = levels
        w = QuantWeight(kind, q, tensor(sub, np.int8), tensor(min_sub, np.int8), group, tensor(factors, np.float16),
                        tensor(min_factors, np.float16))
    else:
        scales, mins = tensor(scales, np.float32), tensor(mins, np.float32)
        if qtype.name in HALF_SCALES and all(bool(torch.isfinite(t.half()).all()) for t in (scales, mins) if t is not None):
            scales, mins = scales.half(), None if mins is None else mins.half()  # the file's fp16 values: exact
        w = QuantWeight(kind, q, scales, mins, group)  # Q4_0: symmetric
    return w if compact else w.expanded()


def _direct_values(kind: str, blocks: np.ndarray) -> np.ndarray | None:
    """The values of Q8_0 (int8 after the scale) and Q4_0 / Q4_1 (32 nibbles after the scale (and min): byte i
    holds value i in its low nibble and value i + 16 in its high one) read from the bytes; None for other types."""
    if kind == "Q8_0":
        return blocks[:, 2:].view(np.int8)
    if kind in ("Q4_0", "Q4_1"):
        packed = blocks[:, 2 if kind == "Q4_0" else 4:]
        return np.concatenate([packed & 0x0F, packed >> 4], axis=1)
    return None


def _scales(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-group float32 scales (and mins, for int4) of each block of a one-level type, [blocks, groups per block]."""
    f16 = lambda lo: blocks[:, lo:lo + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
    if kind in ("Q8_0", "Q5_0"):
        return f16(0), None
    if kind == "Q4_0":
        return f16(0), None  # its mins, -8 d, are implied (symmetric int4)
    if kind == "Q4_1":
        return f16(0), f16(2)
    raise ValueError(f"{kind} has no lossless quantized form")


def _levels(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """A TWO_LEVEL type's (factors [blocks, 1] fp16, sub-scales [blocks, groups per block] int8) for its scales and
    (Q4_K) its mins (None, None for Q6_K): the group's scale is factor * sub-scale; None for other types."""
    f16 = lambda lo: blocks[:, lo:lo + 2].copy().view(np.float16)  # noqa: E731
    if kind == "Q6_K":  # ql 128, qh 64, 16 int8 sub-scales, d
        return f16(208), blocks[:, 192:208].copy().view(np.int8), None, None
    if kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit sub-scales and mins (0..63), qs 128
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        sc, m = sc.reshape(len(blocks), 8).astype(np.int8), m.reshape(len(blocks), 8).astype(np.int8)
        return f16(0), sc, -f16(2), m
    return None
