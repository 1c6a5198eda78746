"""Two-level scales of quantized weights (quant.py's formats): GGUF's K-quants as their files store them.

A Q4_K or Q6_K super-block of 256 inputs holds one fp16 factor d (and, Q4_K, dmin) and an integer sub-scale per
group (Q4_K: 6-bit sc and m per 32 values; Q6_K: int8 sc per 16): the group's scale is d * sc, its min -dmin * m.
Kept as one fp32 scale (and min) per group, those products cost 2 bits per weight (Q4_K: two fp32 per 32 values;
Q6_K: one per 16), where the file spends 0.5 (Q4_K: 6-bit sc and m per 32, d and dmin per 256) and 0.56 (Q6_K);
two-level, with int8 sub-scales and fp16 factors, 0.625 and 0.56.

- ``QuantWeight`` (unpacked): ``scales`` (and ``mins``) int8 [N, K / group] sub-scales, ``super_scales`` (and
  ``super_mins``) fp16 [N, K / SUPER] factors; a group's scale is fp32(factor) * fp32(sub-scale), exact (an fp16
  times an integer of at most 8 bits), so every definition of the one-level format (dequantization, the kernels'
  sums) applies to those products unchanged (``product``).
- ``PackedQuant`` (the kernels'): per 16-column block and SUPER inputs one blob of bytes, the 16 columns' fp16
  factors (32 bytes) then each of the SUPER / group groups' 16 int8 sub-scales: ``scales`` (and ``mins``) uint8
  [N / 16, K / SUPER, 32 + 16 SUPER / group] (``blob`` / ``split``); cpu_qview.h's ``qview_group`` reads it.
"""
from __future__ import annotations

import torch

SUPER = 256  # inputs per factor (GGUF's K-quant super-block)


def check(k: int, group: int) -> None:
    """ValueError unless two-level scales fit a row of `k` in groups of `group`: SUPER divides k, group SUPER."""
    if k % SUPER or SUPER % group:
        raise ValueError(f"two-level scales need K a multiple of {SUPER} and a group dividing it, got K = {k}, "
                         f"group {group}")


def product(factors: torch.Tensor, sub: torch.Tensor, group: int) -> torch.Tensor:
    """The one-level float32 scales [..., K / group] of factors [..., K / SUPER] and sub-scales [..., K / group]."""
    return factors.float().repeat_interleave(SUPER // group, dim=-1) * sub.float()


def blob(factors: torch.Tensor, sub: torch.Tensor, group: int) -> torch.Tensor:
    """The packed bytes [N / 16, K / SUPER, 32 + 16 SUPER / group] of factors and sub-scales each already in column
    blocks ([N / 16, K / SUPER, 16] fp16 and [N / 16, K / group, 16] int8)."""
    blocks, supers = factors.shape[:2]
    values = sub.contiguous().view(torch.uint8).reshape(blocks, supers, 16 * (SUPER // group))
    return torch.cat((factors.contiguous().view(torch.uint8), values), dim=2)


def split(packed: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blob's inverse: (factors [..., K / SUPER, 16] fp16, sub-scales [..., K / group, 16] int8)."""
    factors = packed[..., :32].contiguous().view(torch.float16)
    sub = packed[..., 32:].contiguous().view(torch.int8)
    return factors, sub.reshape(*packed.shape[:-1], SUPER // group, 16).flatten(-3, -2)
