"""Gumbel noise that is a pure hash of (sampling seed, output position, token id).

A seeded sequence draws the same tokens whatever its batch mates, after being recomputed, and on any
device: the noise depends on nothing else (kernels/sampling.py draws with Gumbel-max over it).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31, so x * _HASH_MUL never overflows int64 for 32-bit x


def gumbel_noise(seeds: list[int], positions: list[int], vocab_size: int,
                 device: torch.device | str) -> torch.Tensor:  # [num_rows, vocab] float32
    """Standard Gumbel noise, a pure function of (seed, position, token id)."""
    lo, hi, pos = seed_words(seeds, positions)
    words = torch.tensor([lo, hi, pos], dtype=torch.int64, device=device)
    return gumbel_rows(words[0], words[1], words[2], vocab_size)


def seed_words(seeds: list[int], positions: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(low 32 bits, high 32 bits, position) words of each row, for gumbel_rows (built on the host)."""
    seeds_u64 = [s & 0xFFFFFFFFFFFFFFFF for s in seeds]
    return [s & _M32 for s in seeds_u64], [s >> 32 for s in seeds_u64], [q & _M32 for q in positions]


def gumbel_rows(lo: torch.Tensor, hi: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] float32 Gumbel noise from the rows' seed words (on their device)."""
    key = _mix32(_mix32(_mix32(lo ^ 0x9E3779B9) ^ hi) ^ pos)[:, None]  # [num_rows, 1]
    token = torch.arange(vocab_size, dtype=torch.int64, device=lo.device)[None, :]
    bits = _mix32((_mix32(token ^ key) + key) & _M32)  # [num_rows, vocab] uniform 32-bit
    # float64 so that u never rounds to 0 or 1 (float32 would, for ~1 token in 2**24).
    u = (bits.double() + 0.5) / 2.0**32
    return (-torch.log(-torch.log(u))).float()


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (bijective on [0, 2**32)) in int64 arithmetic."""
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    return x ^ (x >> 16)
