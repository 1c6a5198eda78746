"""A GGUF file (llama.cpp's format) as a checkpoint: what it holds, checked and mapped onto Hugging Face terms.

Torch-free (numpy, gguf_header.py and the `gguf` package's type table), so the CLI's preflight can check a file
before the engine starts, and the model config is read through the same validator as config.json
(`model_config.parse_model_config`): `hf_config` maps the file's metadata onto config.json's keys. `hf_tensor_name`
maps llama.cpp's tensor names onto the HF names the forward takes (kernels/gguf_loader.py reads the tensors).
`open_gguf` refuses, in one line each, a file that is not GGUF, is truncated, or holds a tensor type or
architecture this engine does not load, before anything large is read.
"""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from .gguf_header import GGUFHeader

GGUF_SUFFIX = ".gguf"
# general.architecture -> config.json's architecture (llama.cpp writes Mistral's dense models as "llama")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ARCHS_TEXT = "llama (Llama, Mistral), qwen2, qwen3"
# Tensor types loaded (quantized ones are dequantized at load by gguf_loader.tensor_weight)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency divisors (Llama 3.1 rope scaling)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf_path(path: str) -> bool:
    """A model path that names a GGUF file (by its suffix) rather than a checkpoint directory."""
    return path.lower().endswith(GGUF_SUFFIX) and not os.path.isdir(path)


def open_gguf(path: str) -> GGUFHeader:
    """The file's metadata and tensor table (gguf_header.GGUFHeader: nothing else is read), checked by
    check_header; ValueError with one line naming what is wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"--model {path!r}: no such GGUF file")
    header = GGUFHeader(path)
    check_header(header)
    return header


def check_header(header: GGUFHeader) -> None:
    """The architecture and every tensor's type are ones this engine loads, and every tensor lies in the file."""
    path = header.path
    arch = field(header, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHS_TEXT}")
    for t in header.tensors:
        kind = getattr(t.tensor_type, "name", None)
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name!r} has type {kind or f'{t.tensor_type} (unknown)'}, which "
                             f"radixserve does not load; supported: {', '.join(SUPPORTED_TYPES)}")
        if t.data_offset + t.n_bytes > header.size():
            raise ValueError(f"{path} is truncated: tensor {t.name!r} ends past the end of the file")


def field(header: GGUFHeader, key: str, default: Any = None) -> Any:
    """A metadata value (str, int, float, bool or list), or `default` when the key is absent."""
    return header.fields.get(key, default)


def hf_config(header: GGUFHeader) -> dict[str, Any]:
    """config.json's keys (and generation_config's eos ids) for the model the file holds."""
    arch = field(header, "general.architecture")
    a = lambda key, default=None: field(header, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in header.tensors}
    hidden, heads = int(a("embedding_length")), a("attention.head_count")
    if isinstance(heads, list) or isinstance(a("attention.head_count_kv"), list):
        raise ValueError("per-layer head counts (a GGUF array) are not supported")
    head_dim = int(a("attention.key_length") or hidden // int(heads))
    if int(a("attention.value_length") or head_dim) != head_dim:
        raise ValueError(f"value head size {a('attention.value_length')} differs from the key head size {head_dim}")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "hidden_size": hidden, "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")), "num_attention_heads": int(heads),
        "num_key_value_heads": int(a("attention.head_count_kv") or heads), "head_dim": head_dim,
        "max_position_embeddings": int(a("context_length") or 2048),
        "rms_norm_eps": float(f"{a('attention.layer_norm_rms_epsilon', 1e-6):.7g}"),  # stored as float32
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "vocab_size": int(a("vocab_size") or _rows(header, "token_embd.weight")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in names,
        "partial_rotary_factor": int(a("rope.dimension_count") or head_dim) / head_dim,
        "torch_dtype": _stored_dtype(header),
        "bos_token_id": field(header, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": [field(header, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")],
    }
    raw["rope_scaling"] = _rope_scaling(header, arch)
    return raw


def hf_tensor_name(name: str) -> str | None:
    """The HF name of a llama.cpp tensor name; None for rope_freqs (read into the config, not a weight)."""
    if name == ROPE_FREQS:
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in the Llama-family forward")


def _rope_scaling(header: GGUFHeader, arch: str) -> dict[str, Any] | None:
    kind = field(header, f"{arch}.rope.scaling.type", "none")
    freqs = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:  # the divisors as stored: exact whatever scaling produced them
        factors = np.asarray(header.data(freqs), np.float32)
        return {"rope_type": "default", "freq_factors": [float(x) for x in factors]}
    if kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": field(header, f"{arch}.rope.scaling.factor")}
    original = field(header, f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _stored_dtype(header: GGUFHeader) -> str:
    """The checkpoint dtype --dtype auto starts from: float32 for an all-F32 file, float16 for F16 weights,
    else bfloat16 (BF16 weights, and quantized ones, which are dequantized)."""
    kinds = {t.tensor_type.name for t in header.tensors if len(t.shape) > 1}
    return "float32" if kinds <= {"F32"} else "float16" if kinds <= {"F32", "F16"} else "bfloat16"


def _rows(header: GGUFHeader, name: str) -> int:
    return next(int(t.dims[-1]) for t in header.tensors if t.name == name)
