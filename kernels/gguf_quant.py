"""GGUF block tensors as kernels/quant.py's QuantWeight, without loss: the integers and the per-group scales (and
mins) the file stores, in the unpacked form the quantized linears take.

    Q8_0  int8 q,      group 32, scale d
    Q5_0  int8 q - 16, group 32, scale d
    Q6_K  int8 q - 32, group 16, scale d * sc (sc an int8 per 16 values)
    Q4_0  int4 q,      group 32, scale d, min -8 d
    Q4_1  int4 q,      group 32, scale d, min m
    Q4_K  int4 q,      group 32, scale d * sc, min -dmin * m (sc, m 6-bit per 32 values)

Every scale and min is exact in float32 (a float16 times an integer of at most 8 bits). The scales are read from
the blocks' bytes; the integers are recovered from the gguf package's float32 dequantization, q = (x - min) / scale
rounded (exact: x carries at most one rounding of a value whose q is an integer of 4-6 bits), so the nibble and
high-bit layouts are decoded in one place, the gguf package.
"""
from __future__ import annotations

import numpy as np
import torch

from .quant import QuantWeight

# GGUF type -> (QuantWeight kind, group along K)
LOSSLESS = {"Q8_0": ("int8", 32), "Q5_0": ("int8", 32), "Q6_K": ("int8", 16), "Q4_0": ("int4", 32),
            "Q4_1": ("int4", 32), "Q4_K": ("int4", 32)}


def quant_weight(data: np.ndarray, qtype, block_rows: int = 4096) -> QuantWeight:
    """The QuantWeight [rows, row length] of a 2-D GGUF block tensor of a LOSSLESS type (raw bytes [rows, bytes per
    row] as gguf_header.GGUFHeader.data gives them), converted `block_rows` rows at a time (one block's float32
    transient)."""
    parts = [_rows_to_quant(np.asarray(data[i:i + block_rows]), qtype) for i in range(0, data.shape[0], block_rows)]
    return parts[0] if len(parts) == 1 else QuantWeight.cat(parts)


def _rows_to_quant(data: np.ndarray, qtype) -> QuantWeight:
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    kind, group = LOSSLESS[qtype.name]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    scales, mins = _scales(qtype.name, blocks)  # [blocks, values per block // group]
    scales, mins = scales.reshape(rows, -1), None if mins is None else mins.reshape(rows, -1)
    x = dequantize(data, qtype).reshape(rows, -1, group)
    shifted = x if mins is None else x - mins[..., None]
    q = np.rint(shifted / np.where(scales == 0, 1, scales)[..., None]).reshape(rows, -1)
    lo, hi = (-128, 127) if kind == "int8" else (0, 15)
    if q.size and (q.min() < lo or q.max() > hi):
        raise ValueError(f"{qtype.name} values outside {lo}..{hi}: not a lossless {kind} mapping")
    values = torch.from_numpy(q.astype(np.int8 if kind == "int8" else np.uint8))
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a, np.float32))  # noqa: E731
    return QuantWeight(kind, values, as_tensor(scales), as_tensor(mins), group)


def _scales(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-group float32 scales (and mins, for int4) of each block, [blocks, groups per block]."""
    f16 = lambda lo: blocks[:, lo:lo + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
    if kind in ("Q8_0", "Q5_0"):
        return f16(0), None
    if kind == "Q4_0":
        return f16(0), -8 * f16(0)
    if kind == "Q4_1":
        return f16(0), f16(2)
    if kind == "Q6_K":  # ql 128, qh 64, 16 int8 sub-scales, d
        sub = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        return f16(208) * sub, None
    if kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit sub-scales and mins, qs 128
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
        sc, m = sc.reshape(len(blocks), 8).astype(np.float32), m.reshape(len(blocks), 8).astype(np.float32)
        return f16(0) * sc, -(f16(2) * m)
    raise ValueError(f"{kind} has no lossless quantized form")
