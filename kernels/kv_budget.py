"""The KV pool's size: the default budget when none is set, and whole pages (torch-free, so the HTTP process's
preflight can size the pool before the engine loads)."""
from __future__ import annotations

DEFAULT_CPU_KV_TOKENS = 16384  # small on the CPU: several test servers share one machine
CUDA_KV_MEMORY_FRACTION = 1 / 3  # of the free memory before loading; weights and activations need the rest
KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype; int8: kernels/attention/kv_int8.py
INT8_SCALE_BYTES = 4  # one float32 scale per (token, kv head) row of K and of V


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int,
                       kv_cache_dtype: str = "auto") -> int:
    """One token's K and V in the pool: per layer and kv head, head_dim elements of the model's dtype
    (element_size bytes), or head_dim int8 and a float32 scale."""
    row = head_dim + INT8_SCALE_BYTES if kv_cache_dtype == "int8" else head_dim * element_size
    return 2 * num_layers * num_kv_heads * row


def equal_memory_tokens(model_tokens: int, bytes_per_token: int, model_bytes_per_token: int) -> int:
    """The tokens a pool of bytes_per_token per token holds in the memory model_tokens take in the model's dtype
    (model_bytes_per_token each): the same bytes, so an int8 cache holds ~2x a bf16 one's tokens."""
    return model_tokens * model_bytes_per_token // bytes_per_token


def default_cpu_kv_tokens(bytes_per_token: int, model_bytes_per_token: int) -> int:
    """The CPU's default pool: the memory DEFAULT_CPU_KV_TOKENS take in the model's dtype, in tokens of this
    cache."""
    return equal_memory_tokens(DEFAULT_CPU_KV_TOKENS, bytes_per_token, model_bytes_per_token)


def kv_pool_slots(kv_cache_tokens: int, page_size: int) -> int:
    """The KV pool's slots for a kv_cache_tokens setting: whole pages only (the allocator hands out pages)."""
    return max(kv_cache_tokens // page_size, 1) * page_size
