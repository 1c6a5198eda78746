"""Reads the weights of a GGUF file (kernels/gguf_file.py checks and names them) into the engine's float dtype.

Tensor by tensor through the file's memory map: a quantized tensor is dequantized in row blocks (the `gguf`
package's dequantizer, float32) straight into its output tensor, so at most one block's float32 copy exists at a
time, and the pages of the map a tensor was read from are dropped from the process once it is done (a map keeps
every page it touched resident). `tensor_weight` is the one place a GGUF tensor becomes an engine tensor.

llama.cpp's converter reorders the rows of Llama's q / k projections within each head (its rotary takes adjacent
pairs); they are put back in HF order here, since the forward takes HF layout (and makes its own pair order).
Qwen2 / Qwen3 files keep HF order (llama.cpp runs them with NeoX rotary).
"""
from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from .gguf_file import field as gguf_field, hf_tensor_name, open_gguf

logger = logging.getLogger(__name__)

BLOCK_ELEMENTS = 1 << 22  # elements dequantized at a time (16 MB of float32)
_FLOAT_NUMPY = {"F32": np.float32, "F16": np.float16}


@dataclass
class DequantReport:
    """What dequantizing did: the types met, tensors and elements per type, and the largest relative error of the
    engine dtype's values against the float32 dequantized ones (over each tensor's first block)."""

    dtype: torch.dtype
    tensors: dict[str, int] = field(default_factory=dict)
    max_rel_error: float = 0.0
    sampled: int = 0

    def add(self, kind: str, exact: torch.Tensor, cast: torch.Tensor) -> None:
        self.tensors[kind] = self.tensors.get(kind, 0) + 1
        big = exact.abs() > 1e-30
        if bool(big.any()):
            err = ((cast.float() - exact).abs()[big] / exact.abs()[big]).max().item()
            self.max_rel_error = max(self.max_rel_error, err)
        self.sampled += exact.numel()

    def line(self) -> str:
        if not self.tensors:
            return "GGUF: no quantized tensors"
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(self.tensors.items()))
        return (f"GGUF: dequantized {kinds} to {str(self.dtype).removeprefix('torch.')}; max relative error "
                f"against the float32 dequantized values {self.max_rel_error:.2e} over {self.sampled:,} sampled "
                "values")


def load_gguf_state_dict(path: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """All weights of the GGUF file in `dtype` on `device`, keyed by HF name (model.CausalLM takes them)."""
    reader = open_gguf(path)  # checked: architecture, tensor types, sizes
    arch = gguf_field(reader, "general.architecture")
    heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(gguf_field(reader, f"{arch}.attention.head_count_kv") or heads)
    report = DequantReport(dtype)
    state: dict[str, torch.Tensor] = {}
    total = sum(int(t.n_bytes) for t in reader.tensors)
    with tqdm(total=total, desc="loading GGUF weights", unit="B", unit_scale=True, disable=None) as bar:
        for t in reader.tensors:
            name = hf_tensor_name(t.name)
            if name is not None:
                weight = tensor_weight(t, dtype, report)
                if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                    weight = unpermute_rows(weight, heads)
                elif arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                    weight = unpermute_rows(weight, kv_heads)
                state[name] = weight.to(device)
            _drop_pages(reader, t)
            bar.update(int(t.n_bytes))
    logger.info(report.line())
    logger.info("loaded %d tensors from %s", len(state), path)
    return state


def tensor_weight(t, dtype: torch.dtype, report: DequantReport) -> torch.Tensor:
    """One GGUF tensor (a gguf.ReaderTensor) as a `dtype` tensor of its numpy shape ([rows, row length]): float
    types converted, quantized ones dequantized in row blocks; `report` records the quantized ones."""
    kind = t.tensor_type.name
    data = t.data
    if kind == "BF16":  # the reader gives raw bytes [rows, 2 * row length]
        raw = torch.from_numpy(np.array(data).view(np.int16))
        return raw.view(torch.bfloat16).to(dtype)
    if kind in _FLOAT_NUMPY:
        return torch.from_numpy(np.array(data, dtype=_FLOAT_NUMPY[kind])).to(dtype)
    return _dequantize_rows(data, t.tensor_type, dtype, report)


def _dequantize_rows(data: np.ndarray, qtype, dtype: torch.dtype, report: DequantReport) -> torch.Tensor:
    from gguf.quants import dequantize

    rows = data.reshape(-1, data.shape[-1])
    first = dequantize(np.asarray(rows[:1]), qtype)
    row_len = first.shape[-1]
    out = torch.empty((rows.shape[0], row_len), dtype=dtype)
    step = max(1, BLOCK_ELEMENTS // row_len)
    for start in range(0, rows.shape[0], step):
        exact = torch.from_numpy(dequantize(np.asarray(rows[start:start + step]), qtype))
        out[start:start + step] = exact
        if start == 0:
            report.add(qtype.name, exact, out[:step])
    return out.reshape(*data.shape[:-1], row_len)


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's per-head row order for Llama's q / k (rows i, i + d/2 of a head moved next to each
    other): back to HF order, where rotary pairs a row with the one half a head further."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(rows, *w.shape[1:]).contiguous()


def _drop_pages(reader, t) -> None:
    """Drop the map's pages that held tensor `t` from this process (they were copied out)."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):
        pass
