"""Token radix tree (prefix cache) and KV slot allocator. Pure Python: holds only integers."""

from .allocator import KVAllocator
from .radix_cache import EVICTION_POLICIES, RadixCache, TreeNode

__all__ = ["EVICTION_POLICIES", "KVAllocator", "RadixCache", "TreeNode"]
