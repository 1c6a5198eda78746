"""EngineConfig: one frozen dataclass for every engine setting; PolicyConfig nested in it.

Each field carries its CLI help (and choices) in its metadata through `option(...)`, so the
`radixserve serve` flags are generated from these fields (frontend/cli.py) and never listed by hand.
Pure Python: the HTTP process imports this module.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from ..kernels.attention import ATTENTION_BACKENDS
from ..kernels.kv_budget import CUDA_KV_MEMORY_FRACTION, DEFAULT_CPU_KV_TOKENS, KV_CACHE_DTYPES
from ..kernels.quant_spec import QUANTIZATIONS, QUANTIZED_ACTIVATIONS
from ..radix.radix_cache import DEFAULT_REUSE_BONUS, EVICTION_POLICIES
from .checks import check_choice, check_int, check_number
from .sessions import ADMISSION_RATIO

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "cache-aware")
STARVATION_RULES = ("overtake", "aging", "none")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def option(default: Any, help: str, choices: Sequence[str] | None = None, flag: str | None = None,
           aliases: Sequence[str] = ()) -> Any:
    """A dataclass field with its CLI help; `flag` overrides the generated --flag-name, `aliases`
    are further spellings of it (e.g. SGLang's name)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if flag is not None:
        metadata["flag"] = flag
    if aliases:
        metadata["aliases"] = tuple(aliases)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class PolicyConfig:
    """Tuning knobs of the cache-aware schedule policies (defaults chosen by measurement, bench/results).

    Anti-starvation (cache-aware only):
      overtake: a request jumps ahead once more requests that arrived after it were admitted before it
                than max(1, overtake_ratio x the requests that were ahead of it when it arrived): fcfs
                would admit it after those, so it waits at most about (1 + overtake_ratio) times as many
                admissions. Requests arriving in the same step never count as overtaking each other, so
                batch arrivals keep the cache-aware order;
      aging:    a request jumps ahead once it has waited `max_wait_steps` engine steps.
    """

    window: int = option(256, "fresh requests ordered per step (oldest first); the rest stay fcfs")
    block_size: int = option(16, "prompt tokens per hashed block when grouping shared prefixes")
    # Shared lengths are seen in whole blocks, so 1 means: any uncached shared block.
    dedup_min_tokens: int = option(
        1, "defer requests sharing an uncached prefix of at least this many tokens until one has cached it")
    starvation_rule: str = option("overtake", "anti-starvation rule of cache-aware", choices=STARVATION_RULES)
    overtake_ratio: float = option(0.5, "overtake: a request waits at most about (1 + this) x the admissions "
                                        "fcfs would make before it")
    max_wait_steps: int = option(256, "aging: steps a request waits before it jumps ahead")
    # SGLang falls back from lpm to fcfs above 128 waiting: 128 x the default window.
    fcfs_queue_len: int = option(128 * 256, "with more requests waiting than this, order by arrival")
    fair_share: bool = option(True, "order admission by tenant fair share, then priority, then the program's least "
                                    "attained service, before the cache-aware order (scheduler/fair_share.py)")

    def __post_init__(self) -> None:  # names as EngineConfig carries them (flags: --policy-window, ...)
        check_number("policy.overtake_ratio", self.overtake_ratio, lo=0)
        for name in ("window", "block_size", "max_wait_steps", "fcfs_queue_len"):
            check_int(f"policy.{name}", getattr(self, name), lo=1)
        check_int("policy.dedup_min_tokens", self.dedup_min_tokens, lo=0)
        check_choice("policy.starvation_rule", self.starvation_rule, STARVATION_RULES)


def fit_context_to_pool(context_length: int, pool_slots: int, page_size: int, context_set: bool) -> int:
    """The longest request (prompt + output) the engine accepts. `context_length` is the model's, or the smaller
    context_length the user set (`context_set`); `pool_slots` the KV pool's slots (whole pages). A pool that
    cannot hold one request of that length refuses a context the user set (ValueError naming the pool it needs,
    and the largest context that fits) and caps the model's own to what it holds."""
    if pool_slots >= context_length:
        return context_length
    if context_set:
        need = -(-context_length // page_size) * page_size
        raise ValueError(f"context_length {context_length} needs a KV cache of {need} token slots to hold one request "
                         f"that long, and it has {pool_slots}: raise kv_cache_tokens to {need} or more, or lower "
                         f"context_length to {pool_slots}")
    return pool_slots


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = option(None, "checkpoint directory (None: the built-in demo model)")
    dtype: str = option("auto", "weights and activations dtype", choices=DTYPES)
    quantization: str = option(
        "none", "weight-only quantization at load (kernels/quant.py): int8 one scale per output channel, int8-g32 "
                "per 32 inputs, int4 affine (scale and min) per 32 inputs, int4-g128 per 128", choices=QUANTIZATIONS)
    quantized_activations: str = option(
        "auto", "quantized weights at decode (kernels/quant_act.py): none keeps the activations in the model's dtype "
                "(weight-only); int8 quantizes each row per 32 inputs and multiplies with integer dot products "
                "(x86 with AVX2); auto does that for a GGUF file's weights on the fp32 quantized kernel (CPUs "
                "without AVX512-BF16, or --dtype float32), as llama.cpp does", choices=QUANTIZED_ACTIVATIONS)
    context_length: int | None = option(None, "cap the model's context length (None: the model's)")
    kv_cache_tokens: int | None = option(
        None, f"KV cache size in token slots (None: {DEFAULT_CPU_KV_TOKENS} on the CPU; on CUDA, "
              f"{CUDA_KV_MEMORY_FRACTION:.2g} of the GPU memory free before the weights load)")
    kv_cache_dtype: str = option(
        "auto", "KV cache element type: auto (the model's dtype) or int8 (a float32 scale per token and kv head; "
                "~half the bytes of bf16, so the default budget holds ~2x the tokens; the torch backend only)",
        choices=KV_CACHE_DTYPES)
    page_size: int = option(1, "KV page size in tokens")
    chunked_prefill_size: int = option(512, "max prompt tokens computed per step")
    max_running_requests: int = option(64, "max requests decoding together")
    schedule_policy: str = option("cache-aware", "order of the waiting queue", choices=SCHEDULE_POLICIES)
    policy: PolicyConfig = option(PolicyConfig(), "tuning of the cache-aware schedule policies")
    disable_radix_cache: bool = option(False, "turn prefix matching off")
    attention_backend: str = option("auto", "attention kernels (auto: triton on CUDA, else torch)",
                                    choices=ATTENTION_BACKENDS)
    eviction_policy: str = option("lru-reuse", "which cached prefixes go first", choices=EVICTION_POLICIES)
    reuse_bonus: float = option(DEFAULT_REUSE_BONUS, "lru-reuse: a prefix hit h times is kept as if used "
                                                     "reuse_bonus x log2(1 + h) ticks later")
    seed: int = option(0, "seed for requests that give none")
    device: str | None = option(None, "torch device: cpu, cuda or cuda:N (None: cuda if available, else cpu)")
    num_threads: int | None = option(None, "torch intra-op threads for the model (None: the cores this "
                                           "process may use; test servers pass 1)")
    release_host_memory: bool = option(
        False, "CPU: let glibc return freed host memory to the OS (its default) instead of keeping it for the "
               "next step's activations (kernels/host_memory.py)")
    # Shared-prefix (cascade) attention: a radix node locked by several requests of a step is
    # read once for all their queries when its unshared span is at least this long (0 forces it).
    disable_shared_prefix_attention: bool = option(
        False, "read shared prefixes per request instead of once per step")
    shared_prefix_min_tokens: int = option(32, "shortest shared prefix read once for all requests below it (0: any)")
    disable_native_kernels: bool = option(
        False, "CPU: attend with torch's flash attention op instead of radixserve's compiled kernel "
               "(kernels/native.py; used where it builds: Linux with a C compiler; fp32 or bf16, head_dim a "
               "multiple of 32 up to 128)")
    disable_agent_cache: bool = option(
        False, "plain LRU-with-reuse caching, the baseline of bench/agent_trace: no session pins, no look-ahead in "
               "eviction (waiting requests' prefixes last, closed sessions first, sessions expected back last first) "
               "and no program-level scheduling; sessions still open and close")
    session_admission_ratio: float = option(
        ADMISSION_RATIO, "load control of sessions (0: off): once the server is behind (its waiting queue's prefill "
                         "would take 5 s, within the last 30 s), a request that starts a session waits, 120 s at "
                         "most, while the histories of the started sessions coming back, the running requests and "
                         "its own prompt exceed this many KV pools (scheduler/sessions.py); off with "
                         "--disable-agent-cache")
    kv_swap_space: float = option(
        0.0, "GiB of disk for the session swap tier (0: off): an open session's history's KV is copied to a file "
             "in --kv-swap-dir before eviction may take it (only what the file lacks: a turn's new tokens), "
             "and read back into the cache when the session's next request finds the tree lost it "
             "(scheduler/kv_swap.py); the sessions saved least recently go first; off with --disable-agent-cache")
    kv_swap_dir: str | None = option(None, "directory of the session swap tier's files (None: the system's "
                                           "temporary directory); each is unlinked as soon as it is made")
    disable_jump_forward: bool = option(
        False, "structured generation: decode a grammar's forced continuations token by token instead of "
               "appending them at once and computing them in one extend step")

    def __post_init__(self) -> None:
        if isinstance(self.policy, dict):  # Engine(policy={"window": 64}) and JSON configs
            object.__setattr__(self, "policy", PolicyConfig(**self.policy))
        if not isinstance(self.policy, PolicyConfig):
            raise ValueError(f"policy must be a PolicyConfig or a dict of its fields, got {self.policy!r}")
        for name in ("page_size", "chunked_prefill_size", "max_running_requests"):
            check_int(name, getattr(self, name), lo=1)
        for name in ("context_length", "kv_cache_tokens", "num_threads"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo=1)
        check_int("shared_prefix_min_tokens", self.shared_prefix_min_tokens, lo=0)
        check_int("seed", self.seed)
        check_number("reuse_bonus", self.reuse_bonus, lo=0)
        check_number("session_admission_ratio", self.session_admission_ratio, lo=0)
        check_number("kv_swap_space", self.kv_swap_space, lo=0)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("quantized_activations", self.quantized_activations, QUANTIZED_ACTIVATIONS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype != "auto" and self.attention_backend == "triton":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} is read by the torch attention backend only, "
                             "not by triton")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        if self.device is not None and not (isinstance(self.device, str) and _DEVICE.fullmatch(self.device)):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    def resolved_num_threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not on Linux
            return max(1, os.cpu_count() or 1)

    @classmethod
    def from_kwargs(cls, model_path: str | None, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model_path"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model_path=model_path, **kwargs)
