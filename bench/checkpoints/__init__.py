"""Checkpoints that tests and benchmarks build locally (no download): seeded random Llama-family models
(random_weights.py) and scripted ones whose hand-set weights emit fixed texts (scripted.py). The demo model that
ships with the package is not here: kernels/demo.py names it, bench/demo_kit/train.py trains it."""
from .random_weights import (
    ARCHITECTURES,
    DEMO_CONFIG,
    SCRIPT_PRIORITY,
    SCRIPTS,
    TOOL_RESULT_TRIGGER,
    build_checkpoint,
    cache_root,
    cached_checkpoint,
    cached_scripted_checkpoint,
    checkpoint_for,
    random_demo_model_path,
    save_model,
    scripted_model_path,
    shape_of,
)
from .scripted import build_scripted_checkpoint
from ..demo_kit.tokenizer import build_tokenizer, special_token_ids, write_generation_config

__all__ = [
    "ARCHITECTURES", "DEMO_CONFIG", "SCRIPT_PRIORITY", "SCRIPTS", "TOOL_RESULT_TRIGGER", "build_checkpoint",
    "build_scripted_checkpoint", "build_tokenizer", "cache_root", "cached_checkpoint", "cached_scripted_checkpoint",
    "checkpoint_for", "random_demo_model_path", "save_model", "scripted_model_path", "shape_of", "special_token_ids",
    "write_generation_config",
]
