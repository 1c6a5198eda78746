"""Gumbel noise that is a pure hash of (sampling seed, output position, token id).

A seeded sequence draws the same tokens whatever its batch mates, after being recomputed, and on any
device: the noise depends on nothing else (kernels/sampling.py draws with Gumbel-max over it).

On the CPU the noise is computed in column chunks with in-place ops: a [rows, vocab] int64
temporary per hash step would stream gigabytes per step at batch 64 on a 152k vocabulary (a GPU
takes each step in one launch). `gumbel_at` computes it at
chosen token ids only (the draw over a filtered support), `gumbel_argmax` draws over the whole
vocabulary without materialising the noise; both give the bits of `gumbel_rows`.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_HASH_MUL = 0x45D9F3B  # < 2**31, so x * _HASH_MUL never overflows int64 for 32-bit x
_CHUNK_ELEMENTS = 1 << 16  # per chunk: its int64 and float64 buffers stay in the L2 cache


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


def row_keys(lo: torch.Tensor, hi: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # [num_rows, 1] int64
    """Each row's hash key, from its seed words."""
    return _mix32(_mix32(_mix32(lo ^ 0x9E3779B9) ^ hi) ^ pos)[:, None]


def gumbel_rows(lo: torch.Tensor, hi: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] float32 Gumbel noise from the rows' seed words (on their device)."""
    key = row_keys(lo, hi, pos)
    out = torch.empty(key.shape[0], vocab_size, dtype=torch.float32, device=lo.device)
    for start, stop in _chunks(key.shape[0], vocab_size, lo.device):
        ids = torch.arange(start, stop, dtype=torch.int64, device=lo.device).expand(key.shape[0], -1)
        _noise_into(key, ids, out[:, start:stop])
    return out


def gumbel_at(key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [num_rows, num_ids] float32
    """The noise at the given token ids ([num_rows, num_ids] int64) of rows with keys `key` [num_rows, 1]."""
    out = torch.empty(ids.shape, dtype=torch.float32, device=ids.device)
    for start, stop in _chunks(ids.shape[0], ids.shape[1], ids.device):
        _noise_into(key, ids[:, start:stop], out[:, start:stop])
    return out


def gumbel_argmax(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:  # [num_rows] int64
    """(x + noise).argmax(dim=-1) for float32 x [num_rows, vocab] and row keys [num_rows, 1], the
    noise made chunk by chunk: the first maximum, the first NaN where a row has one (argmax's answer)."""
    rows, vocab = x.shape
    best_val = torch.full((rows,), float("-inf"), device=x.device)
    best_idx = torch.zeros(rows, dtype=torch.int64, device=x.device)
    chunks = _chunks(rows, vocab, x.device)
    buf = torch.empty(rows * max((stop - start for start, stop in chunks), default=0), device=x.device,
                      dtype=torch.float32)
    for start, stop in chunks:
        ids = torch.arange(start, stop, dtype=torch.int64, device=x.device).expand(rows, -1)
        score = buf[:rows * (stop - start)].view(rows, stop - start)
        _noise_into(key, ids, score)
        score += x[:, start:stop]
        idx = score.argmax(dim=-1)
        val = score.gather(1, idx[:, None]).squeeze(1)
        # Later chunks win only strictly (ties keep the first index), or with a NaN the best lacks.
        take = (val > best_val) | (val.isnan() & ~best_val.isnan())
        best_val = torch.where(take, val, best_val)
        best_idx = torch.where(take, idx + start, best_idx)
    return best_idx


def _chunks(rows: int, cols: int, device: torch.device) -> list[tuple[int, int]]:
    step = max(256, _CHUNK_ELEMENTS // max(rows, 1)) if device.type == "cpu" else max(cols, 1)
    return [(start, min(start + step, cols)) for start in range(0, cols, step)]


def _noise_into(key: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[r, j] = the noise of token ids[r, j] under key[r] (out: float32, ids' shape)."""
    bits = ids ^ key  # [rows, cols] int64, a fresh buffer the steps below work in
    tmp = torch.empty_like(bits)
    _mix32_(bits, tmp)
    bits.add_(key).bitwise_and_(_M32)
    _mix32_(bits, tmp)  # uniform 32-bit
    # float64 so that u never rounds to 0 or 1 (float32 would, for ~1 token in 2**24).
    u = bits.to(torch.float64).add_(0.5).div_(2.0**32)
    out.copy_(u.log_().neg_().log_().neg_())


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """_mix32 in place (tmp: a buffer of x's shape)."""
    for last in (False, False, True):
        torch.bitwise_right_shift(x, 16, out=tmp)
        x.bitwise_xor_(tmp)
        if not last:
            x.mul_(_HASH_MUL).bitwise_and_(_M32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (bijective on [0, 2**32)) in int64 arithmetic."""
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    return x ^ (x >> 16)
