"""EngineConfig: one frozen dataclass for every engine setting (server flags map onto its fields)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

ATTENTION_BACKENDS = ("auto", "torch", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lru-reuse")
# Kept in sync with scheduler/policy.py (imported there lazily to avoid a cycle).
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "cache-aware")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None
    dtype: str = "auto"
    context_length: int | None = None  # caps the model's own max positions
    kv_cache_tokens: int | None = None  # KV pool size in token slots; None = a device default
    page_size: int = 1
    chunked_prefill_size: int = 512  # max prompt tokens computed per step
    max_running_requests: int = 64
    schedule_policy: str = "cache-aware"
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    eviction_policy: str = "lru-reuse"
    seed: int = 0
    device: str | None = None
    # torch intra-op threads of the process that runs the model; None = the cores this process
    # may use (os.sched_getaffinity). Test servers pass 1.
    num_threads: int | None = None
    # Shared-prefix (cascade) attention: a radix node locked by several requests of a step is
    # read once for all their queries when its unshared span is at least this long (0 forces it).
    disable_shared_prefix_attention: bool = False
    shared_prefix_min_tokens: int = 32

    def __post_init__(self) -> None:
        _positive(self, "page_size")
        _positive(self, "chunked_prefill_size")
        _positive(self, "max_running_requests")
        if self.context_length is not None:
            _positive(self, "context_length")
        if self.kv_cache_tokens is not None:
            _positive(self, "kv_cache_tokens")
        if self.num_threads is not None:
            _positive(self, "num_threads")
        if isinstance(self.shared_prefix_min_tokens, bool) or not isinstance(self.shared_prefix_min_tokens, int) \
                or self.shared_prefix_min_tokens < 0:
            raise ValueError(f"shared_prefix_min_tokens must be an integer >= 0, got {self.shared_prefix_min_tokens!r}")
        _choice(self, "dtype", DTYPES)
        _choice(self, "attention_backend", ATTENTION_BACKENDS)
        _choice(self, "eviction_policy", EVICTION_POLICIES)
        _choice(self, "schedule_policy", SCHEDULE_POLICIES)
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    def resolved_num_threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)

    @classmethod
    def from_kwargs(cls, model_path: str | None, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model_path=model_path, **kwargs)


def _positive(cfg: EngineConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _choice(cfg: EngineConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
