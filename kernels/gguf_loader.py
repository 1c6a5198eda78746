"""Reads the weights of a GGUF file (kernels/gguf_file.py checks and names them) into the engine's float dtype.

Tensor by tensor through the file's memory map: a quantized tensor is dequantized in row blocks (the `gguf`
package's dequantizer, float32) straight into its output tensor, so at most one block's float32 copy exists at a
time, and the pages of the map a tensor was read from are dropped from the process once it is done (a map keeps
every page it touched resident). `tensor_weight` is the one place a GGUF tensor becomes an engine float tensor;
with `keep_quantized`, gguf_quant.quant_weight the one place a block tensor becomes a quant.QuantWeight.

llama.cpp's converter reorders the rows of Llama's q / k projections within each head (its rotary takes adjacent
pairs); they are put back in HF order here, since the forward takes HF layout (and makes its own pair order).
Qwen2 / Qwen3 files keep HF order (llama.cpp runs them with NeoX rotary).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from .gguf_file import field as gguf_field, hf_tensor_name, open_gguf
from .gguf_quant import LOSSLESS, quant_weight
from .quant import QuantWeight, packable

logger = logging.getLogger(__name__)

BLOCK_ELEMENTS = 1 << 20  # elements dequantized at a time by one thread (4 MB of float32)
SAMPLE_ELEMENTS = 1 << 16  # elements of each quantized tensor the error report compares
MIXED = "fused with another type"  # the report's name for parts of a mixed fusion, dequantized
_FLOAT_NUMPY = {"F32": np.float32, "F16": np.float16}


@dataclass
class DequantReport:
    """What loading did with the quantized tensors: per type, how many were kept quantized (lossless QuantWeights)
    and how many dequantized, and the largest relative error of the engine dtype's values against the float32
    dequantized ones (over each dequantized tensor's first SAMPLE_ELEMENTS)."""

    dtype: torch.dtype
    tensors: dict[str, int] = field(default_factory=dict)  # dequantized, per type
    kept: dict[str, int] = field(default_factory=dict)  # kept quantized, per type
    max_rel_error: float = 0.0
    sampled: int = 0

    def add(self, kind: str, exact: torch.Tensor, cast: torch.Tensor) -> None:
        self.tensors[kind] = self.tensors.get(kind, 0) + 1
        big = exact.abs() > 1e-30
        if bool(big.any()):
            err = ((cast.float() - exact).abs()[big] / exact.abs()[big]).max().item()
            self.max_rel_error = max(self.max_rel_error, err)
        self.sampled += exact.numel()

    def keep(self, kind: str) -> None:
        self.kept[kind] = self.kept.get(kind, 0) + 1

    def line(self) -> str:
        count = lambda d: ", ".join(f"{k} ({n} tensors)" for k, n in sorted(d.items()))  # noqa: E731
        parts = []
        if self.kept:
            parts.append(f"kept {count(self.kept)} quantized, without loss")
        if self.tensors:
            parts.append(f"dequantized {count(self.tensors)} to {str(self.dtype).removeprefix('torch.')}; max "
                         f"relative error against the float32 dequantized values {self.max_rel_error:.2e} over "
                         f"{self.sampled:,} sampled values")
        return "GGUF: " + ("; ".join(parts) if parts else "no quantized tensors")


def keeps_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether block tensors stay quantized: on a CPU whose quantized tile kernel runs, in bf16 (that kernel's
    result equals the bf16 linear on the bf16-rounded dequantized weights, so keeping them changes no output)."""
    from . import native

    return device.type == "cpu" and dtype == torch.bfloat16 and native.tiles_ready()


def load_gguf_state_dict(path: str, dtype: torch.dtype, device: torch.device,
                         transform: Callable[[str, torch.Tensor], Any] | None = None,
                         keep_quantized: bool = False) -> dict[str, Any]:
    """All weights of the GGUF file in `dtype` on `device`, keyed by HF name (model.CausalLM takes them). With
    `keep_quantized`, linear weights of a type gguf_quant maps without loss stay quantized (quant.QuantWeight, on the
    CPU; a tied LM head too, from the embedding's blocks) instead of being dequantized; `transform(name, tensor)`
    (quant.load_transform) may replace an F32 / F16 / BF16 tensor, given in float32."""
    header = open_gguf(path)  # checked: architecture, tensor types, sizes
    arch = gguf_field(header, "general.architecture")
    heads = int(gguf_field(header, f"{arch}.attention.head_count"))
    kv_heads = int(gguf_field(header, f"{arch}.attention.head_count_kv") or heads)
    row_heads = {"attn_q": heads, "attn_k": kv_heads} if arch == "llama" else {}
    report = DequantReport(dtype)
    state: dict[str, Any] = {}
    total = sum(int(t.n_bytes) for t in header.tensors)
    with tqdm(total=total, desc="loading GGUF weights", unit="B", unit_scale=True, disable=None) as bar:
        for t in header.tensors:
            name = hf_tensor_name(t.name)
            if name is not None:
                weight = _read(header, t, name, dtype, transform, keep_quantized, report)
                if t.name.split(".")[-2] in row_heads:
                    weight = unpermute_rows(weight, row_heads[t.name.split(".")[-2]])
                state[name] = weight if isinstance(weight, QuantWeight) else weight.to(device)
            header.drop_pages(t)
            bar.update(int(t.n_bytes))
    if keep_quantized:
        _quantized_tied_head(header, state, report)
        _dequantize_mixed_fusions(state, dtype, report)
    logger.info(report.line())
    logger.info("loaded %d tensors from %s", len(state), path)
    return state


def _read(header, t, name: str, dtype: torch.dtype, transform, keep_quantized: bool, report: DequantReport) -> Any:
    if keep_quantized and _keeps(name, t):
        report.keep(t.tensor_type.name)
        return quant_weight(header.data(t), t.tensor_type)
    if transform is not None and t.tensor_type.name in ("F32", "F16", "BF16"):
        weight = tensor_weight(header.data(t), t.tensor_type, torch.float32, report)
        kept = transform(name, weight)
        return weight.to(dtype) if kept is weight else kept
    return tensor_weight(header.data(t), t.tensor_type, dtype, report)


def _quantized_tied_head(header, state: dict[str, Any], report: DequantReport) -> None:
    """A tied LM head as a QuantWeight of the embedding's own blocks (the table stays float for lookups)."""
    embd = next(t for t in header.tensors if t.name == "token_embd.weight")
    if "lm_head.weight" not in state and _keeps("lm_head.weight", embd):
        report.keep(embd.tensor_type.name)
        state["lm_head.weight"] = quant_weight(header.data(embd), embd.tensor_type)
        header.drop_pages(embd)


def _dequantize_mixed_fusions(state: dict[str, Any], dtype: torch.dtype, report: DequantReport) -> None:
    """The forward fuses q / k / v and gate / up into one linear each, which stays quantized only where its parts
    share a kind and group (a Q4_K_M file may hold q, k in Q4_K and v in Q6_K): other parts are dequantized."""
    layers = {name.split(".")[2] for name in state if name.startswith("model.layers.")}
    for idx in layers:
        for group in (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")):
            names = [f"model.layers.{idx}.{group[0]}.{part}.weight" for part in group[1:]]
            kinds = {(w.kind, w.group) if isinstance(w, QuantWeight) else None for w in map(state.get, names)}
            if len(kinds) > 1:
                for name in names:
                    if isinstance(state[name], QuantWeight):
                        state[name] = state[name].dequantize().to(dtype)
                        report.tensors[MIXED] = report.tensors.get(MIXED, 0) + 1


def tensor_weight(data: np.ndarray, qtype, dtype: torch.dtype, report: DequantReport) -> torch.Tensor:
    """One GGUF tensor (its stored data as gguf_header.GGUFHeader.data gives it, and its GGMLQuantizationType) as a
    `dtype` tensor [rows, row length]: float types converted, quantized ones dequantized in row blocks; `report`
    records the quantized ones."""
    kind = qtype.name
    if kind == "BF16":  # the header gives raw bytes [rows, 2 * row length]
        raw = torch.from_numpy(np.array(data).view(np.int16))
        return raw.view(torch.bfloat16).to(dtype)
    if kind in _FLOAT_NUMPY:
        return torch.from_numpy(np.array(data, dtype=_FLOAT_NUMPY[kind])).to(dtype)
    return _dequantize_rows(data, qtype, dtype, report)


def _dequantize_rows(data: np.ndarray, qtype, dtype: torch.dtype, report: DequantReport) -> torch.Tensor:
    """Row blocks dequantized to float32 by the gguf package and cast into one `dtype` tensor, on as many threads
    as torch uses (numpy releases the GIL); the report compares the first SAMPLE_ELEMENTS values."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    rows = data.reshape(-1, data.shape[-1])
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_len = rows.shape[1] // block_bytes * block
    out = torch.empty((rows.shape[0], row_len), dtype=dtype)
    step = max(1, BLOCK_ELEMENTS // row_len)

    def work(start: int) -> None:
        out[start:start + step] = torch.from_numpy(dequantize(np.asarray(rows[start:start + step]), qtype))

    starts = range(0, rows.shape[0], step)
    if len(starts) > 1:
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            list(pool.map(work, starts))
    else:
        work(0)
    sample = max(1, SAMPLE_ELEMENTS // row_len)
    report.add(qtype.name, torch.from_numpy(dequantize(np.asarray(rows[:sample]), qtype)), out[:sample])
    return out.reshape(*data.shape[:-1], row_len)


def unpermute_rows(w: torch.Tensor | QuantWeight, num_heads: int) -> torch.Tensor | QuantWeight:
    """Undoes llama.cpp's per-head row order for Llama's q / k (rows i, i + d/2 of a head moved next to each
    other): back to HF order, where rotary pairs a row with the one half a head further."""
    rows = w.shape[0]
    index = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).transpose(1, 2).reshape(rows)
    return w.rows(index) if isinstance(w, QuantWeight) else w[index].contiguous()


def _keeps(name: str, t) -> bool:
    """A linear weight (not the embedding table, which lookups read) whose type maps onto a QuantWeight."""
    kind = t.tensor_type.name
    return (name != "model.embed_tokens.weight" and len(t.dims) == 2 and kind in LOSSLESS
            and t.dims[0] % LOSSLESS[kind][1] == 0 and packable(t.shape))
