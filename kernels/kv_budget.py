"""The KV pool's size: the default budget when none is set, and whole pages (torch-free, so the HTTP process's
preflight can size the pool before the engine loads)."""
from __future__ import annotations

DEFAULT_CPU_KV_TOKENS = 16384  # small on the CPU: several test servers share one machine
CUDA_KV_MEMORY_FRACTION = 1 / 3  # of the free memory before loading; weights and activations need the rest


def kv_pool_slots(kv_cache_tokens: int, page_size: int) -> int:
    """The KV pool's slots for a kv_cache_tokens setting: whole pages only (the allocator hands out pages)."""
    return max(kv_cache_tokens // page_size, 1) * page_size
