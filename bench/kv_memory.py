"""KV pools of equal memory for the benches: a budget in tokens of the model's dtype, priced in bytes, and the
tokens each KV cache dtype holds in those bytes (kernels/kv_budget.py's row sizes, the pool's own)."""
from __future__ import annotations

from ..kernels.kv_budget import equal_memory_tokens, kv_bytes_per_token


def kv_shape(model_path: str, dtype: str) -> tuple[int, int, int, int]:
    """(layers, kv heads, head_dim, element size of the dtype the server runs the model in: its own rule)."""
    import torch

    from ..kernels.loader import checkpoint_dtype, resolve_dtype
    from ..kernels.model_config import load_model_config

    config = load_model_config(model_path)
    runs_in = resolve_dtype(dtype, checkpoint_dtype(model_path, config), torch.device("cpu"))
    return config.num_layers, config.num_kv_heads, config.head_dim, torch.empty((), dtype=runs_in).element_size()


def pool_tokens(model_tokens: int, shape: tuple[int, int, int, int], kv_cache_dtype: str) -> int:
    """The tokens a kv_cache_dtype pool holds in the bytes model_tokens take in the model's dtype."""
    return equal_memory_tokens(model_tokens, kv_bytes_per_token(*shape, kv_cache_dtype), kv_bytes_per_token(*shape))
