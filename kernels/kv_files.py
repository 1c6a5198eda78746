"""KV rows on disk: the byte mover under the session swap tier (scheduler/kv_swap.py owns what is stored).

A file holds one sequence of tokens' K/V, token-major: token i's record (for each layer, its K row, then its V row,
each with its int8 scale where the pool is Int8KV) lies at i x `bytes_per_token`, so a history grows by appending
and a rewritten one is cut where it diverged. The pool is [layers, slots, kv_heads, head_dim]; a write gathers the
slots' rows of every layer, a read scatters them back into (other) slots, bit for bit. A file is unlinked as soon
as it is made (its descriptor keeps it), so nothing is left on disk however the process ends; the OS page cache
keeps the recent ones in free memory, and the disk the rest.
"""
from __future__ import annotations

import os
import tempfile

import torch

from .attention.kv_int8 import Int8KV


def _planes(cache: torch.Tensor | Int8KV) -> list[torch.Tensor]:
    return [cache.data, cache.scale] if isinstance(cache, Int8KV) else [cache]


class KVFiles:
    def __init__(self, k_cache: torch.Tensor | Int8KV, v_cache: torch.Tensor | Int8KV,
                 directory: str | None = None) -> None:
        self._planes = _planes(k_cache) + _planes(v_cache)  # each [layers, slots, ...]
        self._widths = [p[:, 0].numel() * p.element_size() for p in self._planes]  # bytes of one token's rows
        self.bytes_per_token = sum(self._widths)
        self.device = self._planes[0].device
        self.directory = directory or tempfile.gettempdir()
        if not os.path.isdir(self.directory):
            raise ValueError(f"kv_swap_dir {self.directory!r} is not a directory")
        self._fds: dict[int, int] = {}

    def write(self, key: int, start: int, slots: list[int]) -> None:
        """File `key` holds tokens [0, start) as before, then the K/V of `slots` in order, and nothing after."""
        fd = self._fd(key)
        os.ftruncate(fd, start * self.bytes_per_token)
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        rows = [p.index_select(1, index).movedim(1, 0).contiguous().cpu().view(torch.uint8).reshape(len(slots), -1)
                for p in self._planes]
        data = memoryview(torch.cat(rows, 1).numpy()).cast("B")
        offset, done = start * self.bytes_per_token, 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)

    def read(self, key: int, start: int, slots: list[int]) -> None:
        """The pool's `slots` get the K/V of the file's tokens [start, start + len(slots))."""
        n = len(slots)
        if n == 0:
            return
        buf = torch.empty((n, self.bytes_per_token), dtype=torch.uint8)
        view, offset, done = memoryview(buf.numpy()).cast("B"), start * self.bytes_per_token, 0
        while done < len(view):
            got = os.preadv(self._fds[key], [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"KV swap file {key}: {n} tokens from {start} asked, the file ends first")
            done += got
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        col = 0
        for plane, width in zip(self._planes, self._widths):
            rows = buf[:, col:col + width].contiguous().view(plane.dtype).reshape(n, plane.shape[0], *plane.shape[2:])
            plane.index_copy_(1, index, rows.movedim(0, 1).to(self.device))
            col += width

    def remove(self, key: int) -> None:
        fd = self._fds.pop(key, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for key in list(self._fds):
            self.remove(key)

    def _fd(self, key: int) -> int:
        if key not in self._fds:
            fd, path = tempfile.mkstemp(prefix="radixserve-kv-", suffix=".kv", dir=self.directory)
            os.unlink(path)
            self._fds[key] = fd
        return self._fds[key]

    @property
    def num_bytes(self) -> int:
        """Bytes the files hold on disk (or in the page cache)."""
        return sum(os.fstat(fd).st_size for fd in self._fds.values())
