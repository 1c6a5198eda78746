"""ServerConfig: the HTTP server's own settings plus the EngineConfig it starts the engine with.

The CLI flags are generated from these fields and EngineConfig's (frontend/cli.py); every field's
help text sits beside it (`option(...)`). `model` is the one place the checkpoint is named: the
nested `engine.model_path` always equals it.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..scheduler.checks import check_choice, check_int, check_number
from ..scheduler.config import EngineConfig, option
from .reasoning import REASONING_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# sglang-router's routing policies (`--policy`); cache_aware routes by prefix match, manual by the
# x-smg-routing-key header (README "Replicas and routing").
TENANT_SALTS = ("none", "after-system")  # --tenant-salt (frontend/salt_policy.py)
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")

# What /v1/models lists for the built-in demo model (its cache path is no name to type).
DEMO_MODEL_NAME = "radixserve-demo"


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = option(None, "checkpoint directory (None: the built-in demo model)")
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(30000, "port to listen on (0: any free port, printed in the ready line)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (health endpoints stay open)")
    api_keys: str | None = option(
        None, "a JSON or TOML file mapping API keys to tenants: name, fair-share weight, admin flag, limits (README "
              "\"Tenants\"); --api-key may stand beside it, as an admin key of the tenant \"default\"")
    served_model_name: str | None = option(
        None, f"the model name clients send (None: the checkpoint directory's name, or {DEMO_MODEL_NAME} for the "
              "demo model)")
    chat_template: str | None = option(
        None, "a Jinja chat template file, for a checkpoint without one (or to replace its own)")
    reasoning_parser: str | None = option(
        None, "split <think>...</think> reasoning out of the answer (reasoning_content, reasoning items, thinking "
              "blocks): qwen3, deepseek-r1, or auto (from the chat template); None: the output is all answer",
        choices=REASONING_PARSERS)
    thinking_key: str | None = option(
        None, "the HMAC key that signs /v1/messages thinking blocks, so a block sent back is verified (replicas "
              "behind one router must share it); None: $RADIXSERVE_THINKING_KEY, else a random key per start")
    engine: EngineConfig = option(EngineConfig(), "how the engine loads the model, caches prefixes and schedules requests")
    tenant_salt: str = option(
        "none", "with --api-keys: after-system salts each request with its tenant from the end of its system message "
                "on, so tenants share a common system prompt's KV and nothing after it (frontend/salt_policy.py)",
        choices=TENANT_SALTS)
    max_queued_requests: int = option(256, "requests accepted beyond --max-running-requests before 429")
    max_tokens_default: int = option(2048, "chat: generate until EOS or the context end, capped by this")
    max_n: int = option(16, "the largest n (choices per prompt) a request may ask for")
    stream_interval: int = option(1, "a streamed response's output goes out every N tokens, the first token at once "
                                  "(SGLang's and vLLM's --stream-interval): fewer, larger chunks for busy servers")
    max_body_bytes: int = option(8 * 1024 * 1024, "larger request bodies get 413")
    graceful_timeout_s: float = option(60.0, "on SIGTERM, seconds running requests may take to finish",
                                       flag="--graceful-timeout")
    keep_alive_s: float = option(5.0, "seconds an idle HTTP/1.1 connection stays open (behind a proxy: above the "
                                      "proxy's idle timeout: --replicas workers keep theirs 15 s "
                                      "above sglang-router's 50)", flag="--timeout-keep-alive")
    watchdog_timeout_s: float = option(300.0, "seconds without engine step progress while work is queued "
                                              "before /health returns 503", flag="--watchdog-timeout")
    response_store: str | None = option(None, "SQLite file of stored /v1/responses (WAL mode: replicas may share "
                                              "it); None: in memory, lost at exit")
    response_store_max_items: int = option(1000, "stored responses kept (each holds its whole conversation); "
                                                 "the oldest go first")
    response_store_ttl_s: float = option(30 * 86400.0, "seconds a stored response is kept",
                                         flag="--response-store-ttl")
    disable_log_requests: bool = option(False, "no access log line per request (logger radixserve.access)")
    log_level: str = option("info", "logging level", choices=LOG_LEVELS)
    replicas: int = option(1, "engine workers behind sglang-router (pip install 'radixserve[router]'); each its own "
                              "process, port and GPU (or cores // N torch threads on the CPU)", aliases=("--dp-size",))
    router_policy: str = option("cache_aware", "with --replicas > 1: the router's policy", choices=ROUTER_POLICIES)

    def __post_init__(self) -> None:
        check_int("port", self.port, 0, 65535)
        check_int("max_queued_requests", self.max_queued_requests, lo=0)
        check_int("max_tokens_default", self.max_tokens_default, lo=1)
        check_int("max_n", self.max_n, lo=1)
        check_int("stream_interval", self.stream_interval, lo=1)
        check_int("max_body_bytes", self.max_body_bytes, lo=1)
        check_number("graceful_timeout_s", self.graceful_timeout_s, lo=0)
        check_number("keep_alive_s", self.keep_alive_s, lo=0, lo_open=True)
        check_number("watchdog_timeout_s", self.watchdog_timeout_s, lo=0, lo_open=True)
        check_int("response_store_max_items", self.response_store_max_items, lo=1)
        check_number("response_store_ttl_s", self.response_store_ttl_s, lo=0, lo_open=True)
        check_choice("log_level", str(self.log_level).lower(), LOG_LEVELS)
        check_int("replicas", self.replicas, lo=1)
        check_choice("router_policy", self.router_policy, ROUTER_POLICIES)
        check_choice("tenant_salt", self.tenant_salt, TENANT_SALTS)
        if self.reasoning_parser is not None:
            check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        for secret in ("api_key", "thinking_key"):
            if getattr(self, secret) == "":
                raise ValueError(f"{secret} must not be empty")
        object.__setattr__(self, "engine", self._engine_with_model())

    def _engine_with_model(self) -> EngineConfig:
        engine = EngineConfig(**self.engine) if isinstance(self.engine, dict) else self.engine
        if not isinstance(engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig or a dict of its fields, got {engine!r}")
        if engine.model_path is not None and engine.model_path != self.model:
            raise ValueError(f"the model is named twice ({self.model!r} and engine.model_path "
                             f"{engine.model_path!r}); set ServerConfig.model only")
        return replace(engine, model_path=self.model)

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for Engine(model, **kwargs) (every EngineConfig field but model_path)."""
        return {f.name: getattr(self.engine, f.name) for f in fields(EngineConfig) if f.name != "model_path"}

    def model_name(self) -> str:
        """The name clients pass as `model` (and /v1/models lists)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEMO_MODEL_NAME
        return os.path.basename(os.path.normpath(self.model)) or self.model  # ./m and ./m/ are both "m"

    def public_dict(self) -> dict[str, Any]:
        """Server and engine settings as one flat dict for /get_server_info, the keys masked."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        engine = asdict(self.engine)
        del engine["model_path"]  # == model
        out.update(engine)
        for secret in ("api_key", "thinking_key"):
            if out[secret] is not None:
                out[secret] = "***"
        return out
