"""ModelConfig: what the Llama-family forward needs, read from a Hugging Face checkpoint directory.

Both config.json layouts are understood: transformers 5 (``rope_parameters`` dict holding
``rope_theta``) and older ones (top-level ``rope_theta`` plus an optional ``rope_scaling`` dict).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from .gguf_file import hf_config, is_gguf_path, open_gguf

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPE_NAMES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    rope_theta: float
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3
    # Divisors of each inverse frequency as a GGUF file stores them (its rope_freqs tensor); None = none
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    # Window of sliding-window layers (attend to kv positions > pos - window); None = full attention.
    sliding_window: int | None
    layer_sliding_windows: tuple[int | None, ...]  # per layer: sliding_window or None
    qkv_bias: bool  # Qwen2 always, Llama/Qwen3 with attention_bias
    o_bias: bool  # Llama/Qwen3 with attention_bias
    mlp_bias: bool  # Llama with mlp_bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim of q and k before rotary
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]  # generation_config.json then config.json, deduplicated
    bos_token_id: int | None
    # Checkpoint dtype from load_model_config; the runner replaces it with the dtype it runs in.
    dtype: str

    @property
    def num_q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


def load_model_config(model_path: str) -> ModelConfig:
    """Reads config.json (+ generation_config.json when present) of a checkpoint directory, or the metadata of a
    GGUF file (gguf_file.hf_config maps it onto config.json's keys)."""
    if is_gguf_path(model_path):
        return parse_model_config(hf_config(open_gguf(model_path)))
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory (expected a Hugging Face "
                         "checkpoint directory with config.json and *.safetensors)")
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"missing file: {config_file} (a Hugging Face checkpoint needs config.json)")
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    gen = _read_generation_config(model_path)
    return parse_model_config(raw, gen)


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Builds a ModelConfig from config.json's dict (and generation_config.json's, if any)."""
    architecture = _architecture(raw)
    hidden_size = int(raw["hidden_size"])
    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    num_layers = int(raw["num_hidden_layers"])
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}: only SwiGLU (silu) models are supported")
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    windows = _layer_sliding_windows(raw, architecture, num_layers)
    active = [w for w in windows if w is not None]
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(raw),
        sliding_window=max(active) if active else None,
        layer_sliding_windows=tuple(windows),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(generation, raw),
        bos_token_id=raw.get("bos_token_id"),
        dtype=normalize_dtype_name(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )


def normalize_dtype_name(name: str) -> str:
    """Maps "bf16", "torch.bfloat16", "float" ... onto float32 | bfloat16 | float16."""
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}: use float32, bfloat16 or float16")
    return _DTYPE_NAMES[key]


# ---------------------------------------------------------------------------------------------
# private helpers


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        model_type = raw.get("model_type", "")
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                   "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        if model_type in by_type:
            return by_type[model_type]
        raise ValueError(f"config.json names no architecture (model_type={model_type!r}); "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 keeps everything in rope_parameters; older files split rope_theta / rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"unsupported rope_parameters per layer type ({', '.join(params)}); "
                         "only one rope setting for all layers is supported")
    scaling = raw.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type == "default":
        factors = params.get("freq_factors")
        return RopeConfig(rope_type="default", rope_theta=float(theta),
                          freq_factors=None if factors is None else tuple(float(f) for f in factors))
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor' in rope_parameters/rope_scaling")
    if rope_type == "linear":
        return RopeConfig(rope_type="linear", rope_theta=float(theta), factor=float(params["factor"]))
    original = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    return RopeConfig(
        rope_type="llama3", rope_theta=float(theta), factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original))


def _layer_sliding_windows(raw: dict[str, Any], architecture: str, num_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if architecture == "LlamaForCausalLM" or not window:
        return [None] * num_layers
    if architecture == "MistralForCausalLM":
        return [int(window)] * num_layers
    # Qwen2/Qwen3: only with use_sliding_window; which layers slide comes from layer_types,
    # else (older files) the layers from max_window_layers on.
    if not raw.get("use_sliding_window", False):
        return [None] * num_layers
    layer_types = raw.get("layer_types")
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    first = int(raw.get("max_window_layers", num_layers))
    return [int(window) if i >= first else None for i in range(num_layers)]


def _eos_ids(generation: dict[str, Any] | None, raw: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation or {}, raw):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


def _read_generation_config(model_path: str) -> dict[str, Any] | None:
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        logger.debug("no generation_config.json in %s; EOS ids come from config.json", model_path)
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
