"""ServerConfig: the HTTP server's settings. The CLI reads its defaults from these fields."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from radixserve.scheduler.config import EngineConfig

# Fields handed to Engine(model, **config); their defaults are the engine's.
ENGINE_FIELDS = (
    "dtype",
    "context_length",
    "kv_cache_tokens",
    "page_size",
    "chunked_prefill_size",
    "max_running_requests",
    "schedule_policy",
    "disable_radix_cache",
    "attention_backend",
    "eviction_policy",
    "seed",
    "device",
    "num_threads",
    "disable_shared_prefix_attention",
    "shared_prefix_min_tokens",
)
_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# What /v1/models lists for the built-in demo model (its cache path is no name to type).
DEMO_MODEL_NAME = "radixserve-demo"


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # checkpoint directory; None = the built-in demo model
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # None = the model path (DEMO_MODEL_NAME for the demo)
    # Engine settings (EngineConfig validates them).
    dtype: str = _ENGINE_DEFAULTS["dtype"]
    context_length: int | None = _ENGINE_DEFAULTS["context_length"]  # None = the model's
    kv_cache_tokens: int | None = _ENGINE_DEFAULTS["kv_cache_tokens"]  # None = the engine's device default
    page_size: int = _ENGINE_DEFAULTS["page_size"]
    chunked_prefill_size: int = _ENGINE_DEFAULTS["chunked_prefill_size"]
    max_running_requests: int = _ENGINE_DEFAULTS["max_running_requests"]
    schedule_policy: str = _ENGINE_DEFAULTS["schedule_policy"]
    disable_radix_cache: bool = _ENGINE_DEFAULTS["disable_radix_cache"]
    attention_backend: str = _ENGINE_DEFAULTS["attention_backend"]
    eviction_policy: str = _ENGINE_DEFAULTS["eviction_policy"]
    seed: int = _ENGINE_DEFAULTS["seed"]
    device: str | None = _ENGINE_DEFAULTS["device"]
    num_threads: int | None = _ENGINE_DEFAULTS["num_threads"]  # None = the cores this process may use
    disable_shared_prefix_attention: bool = _ENGINE_DEFAULTS["disable_shared_prefix_attention"]
    shared_prefix_min_tokens: int = _ENGINE_DEFAULTS["shared_prefix_min_tokens"]
    # Server-only settings.
    max_queued_requests: int = 256  # admitted beyond max_running_requests before 429
    max_tokens_default: int = 2048  # chat: generate until EOS/context end, capped by this
    max_n: int = 16  # largest `n` (choices per prompt) a request may ask for
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    graceful_timeout_s: float = 60.0  # SIGTERM: how long running requests may take to drain
    log_level: str = "info"

    def __post_init__(self) -> None:
        _check_range("port", self.port, 0, 65535)
        _check_range("max_queued_requests", self.max_queued_requests, 0)
        _check_range("max_tokens_default", self.max_tokens_default, 1)
        _check_range("max_n", self.max_n, 1)
        _check_range("max_body_bytes", self.max_body_bytes, 1)
        if self.graceful_timeout_s < 0:
            raise ValueError(f"graceful_timeout_s must be >= 0, got {self.graceful_timeout_s}")
        EngineConfig.from_kwargs(self.model, **self.engine_kwargs())  # raises ValueError on a bad engine setting
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for Engine(model, **kwargs)."""
        return {name: getattr(self, name) for name in ENGINE_FIELDS}

    def model_name(self) -> str:
        """The name clients pass as `model` (and /v1/models lists)."""
        return self.served_model_name or self.model or DEMO_MODEL_NAME

    def public_dict(self) -> dict[str, Any]:
        """The settings as a dict for /get_server_info, with the API key masked."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["api_key"] is not None:
            out["api_key"] = "***"
        return out


def _check_range(name: str, value: int, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        upper = hi if hi is not None else "inf"
        raise ValueError(f"{name} must be in [{lo}, {upper}], got {value}")
