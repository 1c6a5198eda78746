"""The int8 KV cache (``kv_cache_dtype="int8"``): K and V rows quantized as they are stored.

Each row (token, kv head) of K and of V is stored as head_dim int8 values and one float32 scale,
symmetric: scale = max|x| / 127, x ~ scale * round(x / scale), so an element is off by at most
scale / 2. The scale is float32, not bf16: it multiplies in the kernel as it is, and costs 2 bytes per
row more than a bf16 one (3% of a 64-dim row), where a bf16 scale would put a systematic error of up to
2^-9 on the whole row on top of the rounding. A row of head_dim 64 takes 68 bytes instead of 128 in
bf16: the pool holds 1.88x the tokens in the same memory (3.8x an fp32 pool's).

``Int8KV`` holds both tensors of a pool (all layers, or one layer: ``pool[layer]``), so the model
passes it where a float pool goes. The native kernel reads it in place (native.attend_tokens: the ints
widened exactly, K's scale on the scores, V's on the probabilities); the torch readers dequantize what
they gather (``gather``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = 127  # symmetric: -127 .. 127 (-128 unused)


@dataclass(frozen=True)
class Int8KV:
    """data int8 [..., slots, kv_heads, head_dim] and scale float32 [..., slots, kv_heads]."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device) -> "Int8KV":
        return cls(torch.zeros(shape, dtype=torch.int8, device=device),
                   torch.zeros(shape[:-1], dtype=torch.float32, device=device))

    @classmethod
    def of(cls, x: torch.Tensor) -> "Int8KV":
        """x [..., head_dim] quantized (a test's pool; a NaN row keeps a NaN scale, so reading it shows)."""
        data, scale = quantize(x)
        return cls(data, scale)

    def __getitem__(self, layer: int) -> "Int8KV":
        return Int8KV(self.data[layer], self.scale[layer])

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def device(self) -> torch.device:
        return self.data.device

    def store(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Rows x [n, kv_heads, head_dim] quantized into slots [n]."""
        self.data[slots], self.scale[slots] = quantize(x)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The rows at ``index`` (any integer tensor over slots) dequantized to float32."""
        return self.data[index].float() * self.scale[index][..., None]

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.scale[..., None]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (int8 [..., d], float32 scale [...]) with x ~ scale * ints, |error| <= scale / 2.
    A zero row gets scale 0 and ints 0; a row with a NaN gets a NaN scale."""
    xf = x.float()
    scale = xf.abs().amax(-1) / QMAX
    ints = torch.where(scale[..., None] > 0, xf / scale[..., None], 0.0).round_().clamp_(-QMAX, QMAX)
    return ints.to(torch.int8), scale


def gather(cache: torch.Tensor | Int8KV, index: torch.Tensor) -> torch.Tensor:
    """cache[index]: a float pool's rows as they are, an int8 pool's dequantized to float32."""
    return cache.rows(index) if isinstance(cache, Int8KV) else cache[index]


def read_dtype(cache: torch.Tensor | Int8KV, q_dtype: torch.dtype) -> torch.dtype:
    """The dtype q is read in over this pool: the pool's (the model's), or over int8 q's own."""
    return q_dtype if isinstance(cache, Int8KV) else cache.dtype


def make_pool(shape: tuple[int, ...], kv_cache_dtype: str, dtype: torch.dtype, device: torch.device):
    """(K, V) pools of ``shape`` [layers, slots, kv_heads, head_dim]: in ``dtype`` (kv_cache_dtype "auto"),
    or Int8KV ("int8")."""
    if kv_cache_dtype == "int8":
        return Int8KV.zeros(shape, device), Int8KV.zeros(shape, device)
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be auto or int8, got {kv_cache_dtype!r}")
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
