"""The binary layout of a GGUF file (version 2 or 3, little-endian): its metadata and tensor table, read in one pass
over a read-only map, and each tensor's bytes as a numpy view of that map.

gguf.GGUFReader builds a numpy view per metadata element (seconds for a 150,000-token vocabulary, and again in every
process that opens the file); this reads what the engine needs: scalars and numeric arrays as values, string arrays
of more than MAX_STRINGS elements (the tokenizer's, which transformers reads itself) as their length only. A file
cut anywhere is refused in one line: metadata past the end, or a tensor whose bytes lie past it.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
MAX_STRINGS = 64  # longer string arrays are kept as their length
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the row length
    tensor_type: Any  # gguf.GGMLQuantizationType, or the number of a type the gguf package does not know
    data_offset: int  # from the start of the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order of the values: [rows, row length]."""
        return tuple(reversed(self.dims))


class GGUFHeader:
    """`fields` (key -> value) and `tensors` (TensorInfo, in file order) of a GGUF file; `data(t)` maps t's bytes."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            if self._take(4) != MAGIC:
                raise ValueError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
            version, num_tensors, num_fields = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            self.fields: dict[str, Any] = {}
            for _ in range(num_fields):
                key = self._string()
                self.fields[key] = self._value(self._unpack("<I"))
            raw = [(self._string(), [self._unpack("<Q") for _ in range(self._unpack("<I"))], self._unpack("<I"),
                    self._unpack("<Q")) for _ in range(num_tensors)]
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is truncated or corrupt: its metadata runs past the end of the file "
                             f"({type(exc).__name__})") from None
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0:
            raise ValueError(f"{path} is corrupt: general.alignment is {align!r}")
        start = -(-self._pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, type_id, offset in raw:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:  # gguf_file.check_header refuses it, naming it
                self.tensors.append(TensorInfo(name, tuple(dims), type_id, start + offset, 0))
                continue
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
            self.tensors.append(TensorInfo(name, tuple(dims), qtype, start + offset, n_bytes))

    def data(self, t: TensorInfo) -> np.ndarray:
        """t's stored values (F32, F16) or raw bytes [rows, bytes per row] (BF16 and block types), read-only."""
        if t.data_offset + t.n_bytes > len(self._map):
            raise ValueError(f"{self.path} is truncated: tensor {t.name!r} ends past the end of the file")
        kind = t.tensor_type.name
        if kind in ("F32", "F16"):
            dtype = np.float32 if kind == "F32" else np.float16
            return np.frombuffer(self._map, dtype, t.n_bytes // np.dtype(dtype).itemsize, t.data_offset).reshape(
                t.shape)
        raw = np.frombuffer(self._map, np.uint8, t.n_bytes, t.data_offset)
        return raw.reshape(*t.shape[:-1], t.n_bytes // max(1, int(np.prod(t.shape[:-1], dtype=np.int64))))

    def drop_pages(self, t: TensorInfo) -> None:
        """Drop the map's pages that held t from this process's memory (once its values are copied out)."""
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        if hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)

    def last_offset(self) -> int:
        return max((t.data_offset + t.n_bytes for t in self.tensors), default=0)

    def size(self) -> int:
        return len(self._map)

    # -- the parse -------------------------------------------------------------------------------

    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._map):
            raise IndexError("past the end")
        out = self._map[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._take(self._unpack("<Q")).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise IndexError(f"unknown metadata type {kind}")
        item, count = self._unpack("<I"), self._unpack("<Q")
        if item in _NUMPY:
            values = np.frombuffer(self._take(count * np.dtype(_NUMPY[item]).itemsize), _NUMPY[item])
            return values.tolist()
        if item == _STRING and count > MAX_STRINGS:
            for _ in range(count):
                length = self._unpack("<Q")  # (read before the position moves on)
                self._pos += length
            if self._pos > len(self._map):
                raise IndexError("past the end")
            return count
        return [self._value(item) for _ in range(count)]
