"""Building blocks of the Llama-family forward: RMSNorm, rotary embedding, SwiGLU.

Numerics follow transformers' own modules (norm in float32 then cast back, rotary cos/sin
computed in float32 then cast to the activation dtype) so fp32 runs match HF to ~1e-6.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import native, quant, quant_linear
from .model_config import RopeConfig

NATIVE_MAX_ROWS = 2  # rows of an unpacked bf16 weight that take the native kernel (see Linear)


class Linear:
    """y = x W^T + b for 2-D x. On the CPU, a bfloat16 weight whose shape tiles (N a multiple of 16, K of
    32) on a CPU with AMX or AVX512-BF16 is packed once for the native tile kernel (``native.linear_tiles``:
    AMX tiles, else vdpbf16ps over the same layout), which streams it at the machine's read bandwidth at
    every decode row count and keeps up with oneDNN to a few hundred rows (AMX) or at every row count
    (vdpbf16ps; bench/results/decode_floor_L.md), with no per-shape state. Otherwise float32 / bfloat16
    weights are packed once into oneDNN's blocked layout (``torch.ops.mkldnn``, what torch's own CPU compiler
    uses), which streams a skinny batch's weights faster than ``F.linear``. A weight kept as it is
    (``pack=False``: a tied LM head, whose rows the embedding lookup reads) in bf16 takes the native
    row kernel (``native.linear_bf16``) for a step of at most ``NATIVE_MAX_ROWS`` rows, where it
    streams the weight faster than ``F.linear`` (and beyond which it falls behind); otherwise
    ``F.linear``. A quantized weight (``quant.QuantWeight``, from ``--quantization``) is packed for the
    quantized tile kernel (``quant.pack`` / ``quant_linear.linear``); a list of them (``quant.cat_rows``: a fusion's parts in
    different formats) becomes a ``quant.QuantStack``."""

    __slots__ = ("weight", "bias", "tiles", "packed", "native", "quant")

    def __init__(self, weight: torch.Tensor | quant.QuantWeight | list[quant.QuantWeight], bias: torch.Tensor | None, pack: bool = True, tiles: bool = True) -> None:
        """``tiles=False`` packs for oneDNN even where the tile kernel could run (bench/decode_floor.py's
        side-by-side)."""
        self.bias = bias
        quantized = isinstance(weight, (quant.QuantWeight, quant.PackedQuant, list))
        self.quant = quant.packed(weight) if quantized else None
        if self.quant is not None:
            self.tiles = self.packed = self.weight = None
            self.native = False
            return
        self.tiles = native.pack_tiles(weight) if pack and tiles and native.tiles_supported(weight) else None
        self.packed = _prepack(weight, bias) if pack and self.tiles is None else None
        self.native = not self.is_packed and native.linear_bf16_supported(weight)
        self.weight = None if self.is_packed else weight  # a packed copy replaces it

    @property
    def is_packed(self) -> bool:
        """Whether the layer holds its own packed copy of the weight (not the tensor it was given)."""
        return self.tiles is not None or self.packed is not None or self.quant is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.quant is not None:
            return quant_linear.linear(x, self.quant, self.bias)
        if self.tiles is not None:  # no per-shape state: any row count runs as it is
            return native.linear_tiles(x, self.tiles, self.bias)
        if self.native and rows <= NATIVE_MAX_ROWS:
            return native.linear_bf16(x, self.weight, self.bias)
        if x.device.type == "cpu" and (bucket := row_bucket(rows)) != rows:
            # oneDNN builds (JIT-compiles) and caches a primitive per row count, ~3 ms and ~0.5 MB each,
            # so a step size never seen before is slow and every one seen stays in memory: a bounded set
            # of row counts bounds both. The padding rows are zeros and their outputs are dropped.
            padded = x.new_zeros((bucket, x.shape[1]))
            padded[:rows] = x
            return self._apply(padded)[:rows]
        return self._apply(x)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def row_bucket(rows: int) -> int:
    """The row count a CPU matmul of ``rows`` rows runs at: 1, 2, 4, 8, 16, then multiples of 16 up to
    128, then 8 steps per doubling (at most 1/8 padded work where a matmul is compute-bound; below 128
    rows a matmul streams its weights, so padding rows there costs almost nothing). 53 sizes up to 4,096."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    step = max(16, 1 << (rows.bit_length() - 4))
    return -(-rows // step) * step


def _prepack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    ops = torch.ops.mkldnn
    if (weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16)
            or not torch.backends.mkldnn.is_available() or not hasattr(ops, "_reorder_linear_weight")):
        return None
    try:
        packed = ops._reorder_linear_weight(weight)
        probe = torch.randn((3, weight.shape[1]), dtype=weight.dtype)
        got = ops._linear_pointwise(probe, packed, bias, "none", [], "")
        tol = 1e-3 if weight.dtype == torch.float32 else 1e-1
        if not torch.allclose(got.float(), F.linear(probe, weight, bias).float(), atol=tol, rtol=tol):
            return None
        return packed
    except (RuntimeError, TypeError):  # an older oneDNN or an unsupported shape: plain F.linear
        return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x / rms(x) * weight, statistics in float32.

    float32 activations take torch's fused kernel (one pass; bit-identical to the formula below
    on fp32); other dtypes keep transformers' order of casts exactly."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    input_dtype = x.dtype
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(input_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a fused [gate | up] projection."""
    gate, up = gate_up.chunk(2, dim=-1)  # each [num_tokens, intermediate]
    return F.silu(gate).mul_(up)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32 for the supported rope types."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.rope_theta ** exponents)  # [head_dim // 2]
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def pair_interleave(head_dim: int) -> torch.Tensor:
    """The order that puts each rotary pair (i, i + head_dim / 2) side by side: [0, h, 1, h + 1, ...]."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()


def interleave_rotary_pairs(t: torch.Tensor | quant.QuantWeight, head_dim: int) -> torch.Tensor | quant.QuantWeight:
    """t with every head's dims in pair_interleave order along dim 0: q / k projection weights and biases
    ([heads * head_dim, ...]) or a per-head q / k norm weight ([head_dim]). The loader reorders q and k alike, so
    q . k, the attention and the output are unchanged, and rotary becomes one complex multiply per pair. A
    quantized weight's rows move with their scales."""
    if isinstance(t, quant.QuantWeight):
        return t.rows(torch.arange(t.shape[0]).reshape(-1, head_dim)[:, pair_interleave(head_dim)].flatten())
    return t.reshape(-1, head_dim, *t.shape[1:])[:, pair_interleave(head_dim)].reshape(t.shape)


class RotaryEmbedding:
    """Neox-style (rotate-half) rotary embedding at arbitrary absolute positions, on q / k whose head dims the
    loader put in pair-interleaved order (interleave_rotary_pairs)."""

    def __init__(self, head_dim: int, rope: RopeConfig, device: torch.device | str) -> None:
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, rope).to(device)  # [head_dim // 2] float32

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What apply_rotary needs at positions [num_tokens]: e^(i * angle) [num_tokens, head_dim // 2] complex64
        for float32 activations; else (cos, sin), each [num_tokens, head_dim // 2], computed in float32 and cast
        to the activation dtype (as transformers does)."""
        if dtype == torch.float32:
            angles = positions.float()[:, None] * self.inv_freq[None, :]
            return torch.polar(torch.ones_like(angles), angles)
        return self.cos_sin(positions, dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of every token's angles, each [num_tokens, head_dim // 2], computed in float32 and cast to
        `dtype` (what the native rotary, kernels/pointwise.py, and apply_rotary's non-fp32 path take)."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], pair-interleaved head dims
    rotation: torch.Tensor | tuple[torch.Tensor, torch.Tensor],  # RotaryEmbedding.rotation
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    # Each pair (a, b) of x rotates as out = (a cos - b sin, b cos + a sin), what rotate-half computes on the
    # halves x1 = a, x2 = b. In float32 that is one complex multiply, several times faster on the CPU than the
    # rotate-half formula on contiguous halves.
    if isinstance(rotation, torch.Tensor):
        if x.stride(-1) != 1 or x.storage_offset() % 2 or any(st % 2 for st in x.stride()[:-1]):
            x = x.contiguous()  # a complex view needs whole pairs (q / k split from the qkv output have them)
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * rotation[:, None, :]).reshape(x.shape)
    cos, sin = rotation[0][:, None, :], rotation[1][:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out_a, out_b = out[..., 0::2], out[..., 1::2]
    torch.mul(a, cos, out=out_a)
    out_a.sub_(b * sin)
    torch.mul(b, cos, out=out_b)
    out_b.add_(a * sin)
    return out


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the band
    # between low_freq_wavelen and high_freq_wavelen interpolated smoothly.
    old_len = float(rope.original_max_position_embeddings)
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
