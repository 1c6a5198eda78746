"""Reads the weights of a GGUF file (kernels/gguf_file.py checks and names them): block tensors of linears kept as
quant.QuantWeights where the quantized kernel runs (keeps_blocks), everything else in the engine's float dtype.

Tensor by tensor through the file's memory map, each when the forward takes it (GGUFState): a quantized tensor is
dequantized in row blocks (the `gguf` package's dequantizer, float32) straight into its output tensor, so at most one
block's float32 copy exists at a time, and the pages of the map a tensor was read from are dropped from the process
once it is done (a map keeps every page it touched resident). `tensor_weight` is the one place a GGUF tensor
becomes an engine float tensor, gguf_quant.quant_weight the one place a block tensor becomes a QuantWeight.

llama.cpp's converter reorders the rows of Llama's q / k projections within each head (its rotary takes adjacent
pairs); they are put back in HF order here, since the forward takes HF layout (and makes its own pair order).
Qwen2 / Qwen3 files keep HF order (llama.cpp runs them with NeoX rotary).
"""
from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from .gguf_file import field as gguf_field, hf_tensor_name, open_gguf
from .gguf_header import GGUFHeader
from .gguf_quant import LOSSLESS, packed_weight, quant_weight
from .quant import PackedQuant, QuantWeight, packable
from .quant_linear import kernel

logger = logging.getLogger(__name__)

BLOCK_ELEMENTS = 1 << 20  # elements dequantized at a time by one thread (4 MB of float32)
SAMPLE_ELEMENTS = 1 << 16  # elements of each quantized tensor the error report compares
_FLOAT_NUMPY = {"F32": np.float32, "F16": np.float16}
# weights kept quantized that the forward takes as they are (no fusion, no row reorder): given packed (PackedQuant)
STANDALONE = re.compile(r"^model\.embed_tokens\.weight$|^lm_head\.weight$|\.(o_proj|down_proj)\.weight$")


@dataclass
class DequantReport:
    """What loading did with the quantized tensors: per type, how many were kept quantized (lossless QuantWeights)
    and how many dequantized, and the largest relative error of the engine dtype's values against the float32
    dequantized ones (over each dequantized tensor's first SAMPLE_ELEMENTS)."""

    dtype: torch.dtype
    tensors: dict[str, int] = field(default_factory=dict)  # dequantized, per type
    kept: dict[str, int] = field(default_factory=dict)  # kept quantized, per type
    kept_file_bytes: int = 0  # the kept tensors' bytes in the file
    kept_bytes: int = 0  # and packed (quant.PackedQuant.nbytes)
    max_rel_error: float = 0.0
    sampled: int = 0
    int8_activations: bool = False  # the kept weights take int8 activations at decode (quant_act.py)

    def add(self, kind: str, exact: torch.Tensor, cast: torch.Tensor) -> None:
        self.tensors[kind] = self.tensors.get(kind, 0) + 1
        big = exact.abs() > 1e-30
        if bool(big.any()):
            err = ((cast.float() - exact).abs()[big] / exact.abs()[big]).max().item()
            self.max_rel_error = max(self.max_rel_error, err)
        self.sampled += exact.numel()

    def keep(self, kind: str, file_bytes: int, held_bytes: int) -> None:
        self.kept[kind] = self.kept.get(kind, 0) + 1
        self.kept_file_bytes += file_bytes
        self.kept_bytes += held_bytes

    def line(self) -> str:
        count = lambda d: ", ".join(f"{k} ({n} tensors)" for k, n in sorted(d.items()))  # noqa: E731
        parts = []
        if self.kept:
            held = f"{self.kept_bytes / 1e9:.2f} GB" if self.kept_bytes >= 1e8 else f"{self.kept_bytes / 1e6:.1f} MB"
            parts.append(f"kept {count(self.kept)} quantized, without loss, in {held} "
                         f"({self.kept_bytes / max(self.kept_file_bytes, 1):.2f}x their bytes in the file)")
        if self.tensors:
            parts.append(f"dequantized {count(self.tensors)} to {str(self.dtype).removeprefix('torch.')}; max "
                         f"relative error against the float32 dequantized values {self.max_rel_error:.2e} over "
                         f"{self.sampled:,} sampled values")
        if self.kept:  # which kernel multiplies them (quant_linear.kernel: tiles, avx512-bf16 or fp32)
            parts.append(f"quantized kernel {kernel(self.dtype)}"
                         + (", int8 activations at decode (--quantized-activations)" if self.int8_activations else ""))
        return "GGUF: " + ("; ".join(parts) if parts else "no quantized tensors")


def keeps_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether block tensors stay quantized: on a CPU where a native quantized kernel runs for the model's dtype
    (quant_linear.kernel(dtype)): in bf16 the AMX tiles or AVX512-BF16 (at least as exact as the bf16 linear on the
    bf16-rounded dequantized weights) or the fp32 kernel; in fp32 the fp32 kernel (the fp32 model of the
    dequantized weights up to the order of its sums), in every build of the library, AVX2 and portable ones too.
    Elsewhere quant_linear.linear would dequantize the weights at every call."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and kernel(dtype) is not None


def load_gguf_state_dict(path: str, dtype: torch.dtype, device: torch.device,
                         transform: Callable[[str, torch.Tensor], Any] | None = None,
                         keep_quantized: bool = False, int8_activations: bool = False) -> "GGUFState":
    """The weights of the GGUF file, keyed by HF name (model.CausalLM takes them), each read when taken (GGUFState).
    With `keep_quantized`, linear weights and the embedding table of a type gguf_quant maps without loss stay
    quantized (quant.QuantWeight, on the CPU: the model looks rows up from it, and a tied LM head is the same packed
    weight) instead of being dequantized to `dtype`;
    `transform(name, tensor)` (quant.load_transform, --quantization) may replace any other tensor, given in
    float32 (a block type dequantized first). `int8_activations` is for the report line only (the runner marks the
    packed weights)."""
    return GGUFState(open_gguf(path), dtype, device, transform, keep_quantized, int8_activations)


class GGUFState(Mapping):
    """A GGUF file's weights by HF name, each read from the file and converted when taken (`pop`, what the forward's
    loader.take does; `[name]` reads without taking): the forward packs each layer as it takes it, so the unpacked
    or converted form of one tensor at a time exists beside the packed model, never the whole model's. Once the
    last is taken the report line is logged."""

    def __init__(self, header: GGUFHeader, dtype: torch.dtype, device: torch.device,
                 transform: Callable[[str, torch.Tensor], Any] | None, keep_quantized: bool,
                 int8_activations: bool = False) -> None:
        self.header, self.dtype, self.device, self.transform = header, dtype, device, transform
        arch = gguf_field(header, "general.architecture")
        heads = int(gguf_field(header, f"{arch}.attention.head_count"))
        self._row_heads = {"attn_q": heads, "attn_k": int(gguf_field(header, f"{arch}.attention.head_count_kv")
                                                             or heads)} if arch == "llama" else {}
        self._infos = {name: t for t in header.tensors if (name := hf_tensor_name(t.name)) is not None}
        self._kept = _kept_names(self._infos) if keep_quantized else set()
        # the compact forms (two-level K-quant scales, Q4_0 without mins) for the kernels that read them
        # (cpu_quant_f32.c, cpu_quant_i8.c), not for the bf16 ones
        self._compact = keep_quantized and kernel(dtype) == "fp32"
        self.report = DequantReport(dtype, int8_activations=int8_activations and keep_quantized)
        self._bar = tqdm(total=sum(t.n_bytes for t in self._infos.values()), desc="loading GGUF weights",
                         unit="B", unit_scale=True, disable=None)

    def __getitem__(self, name: str) -> Any:
        t = self._infos[name]
        if name in self._kept:
            # one linear of its own (not fused, rows in order): packed a block of rows at a time
            convert = packed_weight if STANDALONE.search(name) else quant_weight
            weight = convert(self.header.data(t), t.tensor_type, compact=self._compact)
            self.report.keep(t.tensor_type.name, int(t.n_bytes), weight.nbytes)
        elif self.transform is not None:
            weight = tensor_weight(self.header.data(t), t.tensor_type, torch.float32, self.report)
            kept = self.transform(name, weight)
            weight = weight.to(self.dtype) if kept is weight else kept
        else:
            weight = tensor_weight(self.header.data(t), t.tensor_type, self.dtype, self.report)
        part = t.name.split(".")[-2]
        if part in self._row_heads:
            weight = unpermute_rows(weight, self._row_heads[part])
        self.header.drop_pages(t)
        return weight if isinstance(weight, (QuantWeight, PackedQuant)) else weight.to(self.device)

    def pop(self, name: str, *default: Any) -> Any:
        if name not in self._infos:
            if default:
                return default[0]
            raise KeyError(name)
        weight = self[name]
        self._bar.update(self._infos.pop(name).n_bytes)
        if not self._infos:
            self._bar.close()
            logger.info(self.report.line())
            logger.info("loaded the weights of %s", self.header.path)
        return weight

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._infos))

    def __len__(self) -> int:
        return len(self._infos)


def _kept_names(infos: dict[str, Any]) -> set[str]:
    """The weights that stay quantized: those _keeps allows, less the parts of a fusion (q / k / v, gate / up, one
    linear each in the forward) of which some part is not kept (all are dequantized). Parts in different formats
    stay quantized (a Q4_K_M file's Q6_K v beside Q4_K q / k: quant.cat_rows stacks them)."""
    kept = {name for name, t in infos.items() if _keeps(name, t)}
    layers = {name.split(".")[2] for name in infos if name.startswith("model.layers.")}
    for idx in layers:
        for module, *parts in (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")):
            names = [f"model.layers.{idx}.{module}.{part}.weight" for part in parts]
            if len({n in kept for n in names if n in infos}) > 1:
                kept.difference_update(names)
    return kept


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
    """A linear weight or the embedding table whose type maps onto a QuantWeight."""
    kind = t.tensor_type.name
    return (len(t.dims) == 2 and kind in LOSSLESS
            and t.dims[0] % LOSSLESS[kind][1] == 0 and packable(t.shape))
