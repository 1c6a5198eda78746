"""Checkpoints built locally, with no download, for tests and benchmarks: seeded random Llama-family models, a
random-weight model of the demo model's size, and (scripted.py) checkpoints that emit fixed scripts.

Every builder writes a directory that transformers loads as is: config.json, model.safetensors,
generation_config.json (eos_token_id = [<|im_end|>, <|endoftext|>]) and the tokenizer of demo_tokenizer.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

import torch

from .scripted import build_scripted_checkpoint
from ..demo_kit import corpus as demo_corpus
from ...kernels.cache_dir import cache_root
from ..demo_kit.tokenizer import (
    CHAT_TEMPLATE,
    MIN_VOCAB_SIZE,
    TOOL_RESULT_OPEN,
    build_tokenizer,
    special_token_ids,
    write_generation_config,
)
from ...kernels.model_config import normalize_dtype_name

__all__ = [
    "build_checkpoint",
    "build_scripted_checkpoint",
    "build_tokenizer",
    "cache_root",
    "cached_checkpoint",
    "checkpoint_for",
    "cached_scripted_checkpoint",
    "random_demo_model_path",
    "scripted_model_path",
    "SCRIPTS",
    "shape_of",
    "special_token_ids",
    "write_generation_config",
    "DEMO_CONFIG",
]

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A random-weight model of about the demo model's size (random_demo_model_path; its MLP is 688 wide, the trained
# one's 704). Bump _DEMO_VERSION when the builder's output changes in a way the fingerprint below (config + corpus +
# template source) does not see.
DEMO_CONFIG: dict[str, Any] = dict(
    arch="llama", seed=0, vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
    intermediate_size=688, max_position_embeddings=4096,
)
_DEMO_VERSION = "demo-v1"


def build_checkpoint(
    out_dir: str,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    initializer_range: float = 0.02,
    dtype: str = "float32",
    tokenizer: bool = True,
    max_position_embeddings: int = 2048,
    max_shard_size: int | str | None = None,
    **config_overrides: Any,
) -> str:
    """Build a seeded random checkpoint of `arch` (llama, qwen2, qwen3, mistral) in out_dir and return out_dir.

    config_overrides go to the transformers config as is (rope_theta, rope_scaling, sliding_window,
    tie_word_embeddings, attention_bias, ...). max_shard_size (e.g. "200KB") makes save_pretrained shard the
    weights with a model.safetensors.index.json. Same arguments, same files.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tokenizer and vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} to ship the tokenizer, got {vocab_size}")
    config = _make_config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        head_dim=head_dim if head_dim is not None else hidden_size // num_heads,
        initializer_range=initializer_range,
        max_position_embeddings=max_position_embeddings,
        **_special_ids_for_config(vocab_size),
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = _model_class(arch)(config).to(DTYPES[dtype]).eval()
    save_model(model, out_dir, max_shard_size=max_shard_size)
    if tokenizer:
        build_tokenizer(out_dir, vocab_size)
    return out_dir


def save_model(model: torch.nn.Module, out_dir: str, *, max_shard_size: int | str | None = None) -> None:
    """save_pretrained (safetensors) plus our generation_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)
    write_generation_config(out_dir, model.config.vocab_size)


# Scripts of the standard scripted checkpoint (scripted_model_path()): a tool call, the final answer once the
# tool's result is in the prompt (a priority trigger: it wins over "weather"), a stop string with text after it,
# multi-byte characters split across tokens (the emoji's 4 bytes are 4 tokens), and a plain answer.
TOOL_RESULT_TRIGGER = TOOL_RESULT_OPEN
SCRIPT_PRIORITY = (TOOL_RESULT_TRIGGER,)
SCRIPTS: dict[str, str] = {
    "weather": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    TOOL_RESULT_TRIGGER: "It is sunny in Paris today.",
    "story": "Once upon a time a small robot learned to sing. STOP And then it slept.",
    "emoji": "héllo 世界🚀 ok",
    "hello": "Hello! How can I help you today?",
}


def scripted_model_path() -> str:
    """The standard scripted checkpoint (SCRIPTS), built once into the cache. A prompt containing one trigger word
    (e.g. "What is the weather?") gets that script then EOS; a prompt without a trigger gets EOS at once."""
    return cached_scripted_checkpoint(SCRIPTS, priority=SCRIPT_PRIORITY)


def random_demo_model_path() -> str:
    """The random-weight model of the demo's size (DEMO_CONFIG): built on first use under cache_root(), reused
    afterwards. For tests and benchmarks that need the demo's shapes without its trained weights."""
    fingerprint = _fingerprint(DEMO_CONFIG, demo_corpus.corpus(), CHAT_TEMPLATE)
    path = _cached_dir(f"{_DEMO_VERSION}-{fingerprint}", lambda d: build_checkpoint(d, **DEMO_CONFIG))
    logger.warning("using a demo-sized Llama with RANDOM weights (%s): its text is gibberish", path)
    return path


def cached_checkpoint(arch: str = "llama", **kwargs: Any) -> str:
    """build_checkpoint(dir, arch, **kwargs) into the cache, keyed by the arguments; reused across processes."""
    from ..demo_kit import tokenizer as demo_tokenizer

    # Keyed by this module's and the tokenizer module's source too: editing a builder invalidates old entries.
    key = _fingerprint(dict(arch=arch, **kwargs), inspect.getsource(sys.modules[__name__]),
                       inspect.getsource(demo_tokenizer), demo_corpus.corpus())
    return _cached_dir(f"ckpt-{arch}-{key}", lambda d: build_checkpoint(d, arch, **kwargs))


# config.json keys a random checkpoint in a real model's shape takes over as they are: what the forward and the
# benchmarks depend on. The rest (token ids, tokenizer, quantization, ...) are the builder's own.
_SHAPE_KEYS = ("head_dim", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
               "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers",
               "layer_types", "hidden_act")


def shape_of(config: dict[str, Any]) -> dict[str, Any]:
    """cached_checkpoint's arguments (arch included) for random weights in the shape of a Hugging Face config.json:
    the architecture from model_type, dims, vocabulary, dtype, tied embeddings, head_dim, rope and norms."""
    arch = config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"config model_type must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    if missing := [key for key in required if key not in config]:
        raise ValueError(f"config is missing {', '.join(missing)}")
    dtype = normalize_dtype_name(config.get("dtype") or config.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        raise ValueError(f"config dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return dict(
        arch=arch, vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]), num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
        intermediate_size=int(config["intermediate_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048), dtype=dtype,
        **{key: config[key] for key in _SHAPE_KEYS if config.get(key) is not None},
    )


def checkpoint_for(path: str, seed: int = 0) -> str:
    """A checkpoint directory for `path`: a Hugging Face checkpoint directory is used as it is; a config.json
    ("shape file") gets seeded random weights in its shape (shape_of), built once into the cache."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{path} is a directory without config.json: not a Hugging Face checkpoint")
        return path
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is neither a checkpoint directory nor a config.json file")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON config: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON config object")
    spec = shape_of(config)
    return cached_checkpoint(spec.pop("arch"), seed=seed, **spec)


def cached_scripted_checkpoint(chains: dict[str, Any], **kwargs: Any) -> str:
    """build_scripted_checkpoint(dir, chains, **kwargs) into the cache, keyed by the arguments."""
    from . import scripted

    key = _fingerprint(dict(chains=chains, **kwargs), inspect.getsource(scripted), demo_corpus.corpus())
    return _cached_dir(f"scripted-{key}", lambda d: build_scripted_checkpoint(d, chains, **kwargs))


# ---------------------------------------------------------------------------------------------------------------


def _cached_dir(name: str, build: Callable[[str], Any]) -> str:
    """Build into a temp dir beside the target, then rename: concurrent processes never see a half-built dir."""
    root = cache_root()
    final = os.path.join(root, name)
    if os.path.isdir(final):
        return final
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
            logger.info("built %s", final)
        except OSError:
            if not os.path.isdir(final):  # not the "another process won the race" case
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fingerprint(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _special_ids_for_config(vocab_size: int) -> dict[str, Any]:
    if vocab_size < MIN_VOCAB_SIZE:
        return {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    ids = special_token_ids(vocab_size)
    return {"bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}


def _make_config(arch: str, **kwargs: Any):
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    return cls(**kwargs)


def _model_class(arch: str):
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]

