"""SamplingParams: the per-request generation settings (SGLang/vLLM names)."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import regex as _regex

from ..kernels.forward_io import RowSampling
from .checks import check_int, check_number, check_session_id

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
JSON_OBJECT = "$$ANY$$"  # json_schema value meaning any JSON (response_format json_object); never valid JSON
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: each bias in [-100, 100]
SEED_MAX = 2**63 - 1


def choice_rids(rid: str, n: int) -> list[str]:
    """The request ids of a prompt's `n` choices (SGLang's and OpenAI's `n`): rid itself, or rid-0 .. rid-(n-1)."""
    return [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]


def choice_seed(base: int, i: int) -> int:
    """Choice i samples with seed base + i, wrapped into the signed 64-bit range."""
    seed = base + i
    return seed if seed <= SEED_MAX else seed - 2**64


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Regular expressions (searched in the output text, `regex` module syntax): a match ends the request
    # like a stop string (scheduler/output.py); matched_stop is the pattern, as SGLang reports it.
    stop_regex: list[str] = field(default_factory=list)
    no_stop_trim: bool = False  # keep the matched stop string / stop_regex match in the text
    ignore_eos: bool = False
    spaces_between_special_tokens: bool = True  # passed to decode (SGLang's default)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k count of output logprobs; None = off
    logprob_start_len: int | None = None  # prompt logprobs from this position; None = off
    cache_salt: str | None = None
    # Where the salt starts (a prompt position): tokens before it are keyed in the shared cache, so tenants share a
    # common system prompt's KV and nothing after it (Req.tree_ids). None: the whole prompt is salted.
    cache_salt_after: int | None = None
    # The agent session the request belongs to: its cached path stays pinned for the session's next turn
    # (scheduler/sessions.py). Not a sampling setting, but it travels with the request as cache_salt does.
    session_id: str | None = None
    # Scheduling (scheduler/fair_share.py): the tenant whose fair share the request draws on (set by the server
    # from the API key, never by the client; None: the default tenant), and its priority within that tenant
    # (lower runs first, vLLM's meaning; it may preempt the tenant's own running work of a worse priority).
    tenant: str | None = None
    priority: int = 0
    # Output deltas (set by the server, never by the client; scheduler/output.py): one once at least this many new
    # tokens are out (the first token's at once, the last always); 0: the final one only, for a request nobody
    # streams (its intermediate deltas would be serialized, routed and dropped every step).
    stream_interval: int = 1
    skip_special_tokens: bool = True
    # Structured generation (at most one; compiled with xgrammar in the engine, scheduler/grammar.py).
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    # xgrammar's structural tag ({"type": "structural_tag", "format": ...}, a dict or its JSON text):
    # what the OpenAI layer builds for forced tool calls (frontend/tool_grammar.py).
    structural_tag: str | dict[str, Any] | None = None
    # Reasoning budget (scheduler/reasoning_budget.py): at most reasoning_budget tokens of reasoning, then the
    # engine appends reasoning_end; reasoning_open: None if the output starts in the reasoning, else its opening tag.
    reasoning_budget: int | None = None
    reasoning_end: str | None = None
    reasoning_open: str | None = None
    # OpenAI logit_bias: token id -> bias in [-100, 100], added to that id's logit before sampling
    # (kernels/sampling.py; -100 effectively bans the id, +100 all but forces it).
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex or [])
        if self.logit_bias is not None:
            self.logit_bias = _normalise_bias(self.logit_bias)
        self.validate()

    @classmethod
    def from_any(cls, value: "SamplingParams | dict[str, Any] | None",
                 default_max_new_tokens: int | None = None) -> "SamplingParams":
        """None, a dict (None values = unset) or SamplingParams itself. default_max_new_tokens (the checkpoint's
        generation_config.json) replaces the class default when None or the dict leaves max_new_tokens unset."""
        defaults = {} if default_max_new_tokens is None else {"max_new_tokens": default_max_new_tokens}
        if value is None:
            return cls(**defaults)
        if isinstance(value, SamplingParams):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
            return cls(**{**defaults, **{k: v for k, v in value.items() if v is not None}})
        raise ValueError(f"sampling_params must be a SamplingParams or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def row_sampling(self) -> RowSampling:
        """What the sampler reads of these settings (built once per request)."""
        return RowSampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                           repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                           presence_penalty=self.presence_penalty, logit_bias=self.logit_bias,
                           logprobs=self.logprobs is not None)

    def validate(self) -> None:
        _check_int(self, "max_new_tokens", lo=0)
        _check_int(self, "min_new_tokens", lo=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        _check_float(self, "temperature", lo=0.0, hi=100.0)
        _check_float(self, "top_p", lo=0.0, hi=1.0, lo_open=True)
        _check_int(self, "top_k", lo=-1)
        _check_float(self, "min_p", lo=0.0, hi=1.0)
        _check_float(self, "frequency_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "presence_penalty", lo=-2.0, hi=2.0)
        _check_float(self, "repetition_penalty", lo=0.0, hi=10.0, lo_open=True)
        if self.seed is not None:
            _check_int(self, "seed", lo=-(2**63), hi=SEED_MAX)
        if self.logprobs is not None:
            _check_int(self, "logprobs", lo=0, hi=20)
        if self.logprob_start_len is not None:
            _check_int(self, "logprob_start_len", lo=0)
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers >= 0")
        self._validate_stop_regex()
        for name in ("no_stop_trim", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if self.cache_salt_after is not None:
            _check_int(self, "cache_salt_after", lo=0)
            if self.cache_salt is None:
                raise ValueError("cache_salt_after needs a cache_salt")
        if self.session_id is not None:
            check_session_id(self.session_id)
        if self.tenant is not None:
            check_session_id(self.tenant, "tenant")
        _check_int(self, "priority", lo=-(2**31), hi=2**31 - 1)
        _check_int(self, "stream_interval", lo=0)
        self._validate_grammar()
        self._validate_reasoning()

    @property
    def has_grammar(self) -> bool:
        return any(getattr(self, name) is not None for name in GRAMMAR_FIELDS)

    def _validate_grammar(self) -> None:
        """Types only (cheap, torch-free); the grammar itself is compiled by the engine."""
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of regex, json_schema, ebnf and structural_tag may be set, "
                             f"got {' and '.join(given)}")
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")
        schema = self.json_schema
        if schema is not None and not (isinstance(schema, dict) or (isinstance(schema, str) and schema)):
            raise ValueError("json_schema must be a JSON object or a non-empty string")
        tag = self.structural_tag
        if tag is not None and not (isinstance(tag, dict) or (isinstance(tag, str) and tag)):
            raise ValueError("structural_tag must be a JSON object or a non-empty string")

    def _validate_reasoning(self) -> None:
        for name in ("reasoning_end", "reasoning_open"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string")
        if self.reasoning_budget is not None:
            _check_int(self, "reasoning_budget", lo=1)
            if self.reasoning_end is None:
                raise ValueError("reasoning_budget needs reasoning_end (the text that closes the reasoning)")

    def _validate_stop_regex(self) -> None:
        if not all(isinstance(s, str) and s for s in self.stop_regex):
            raise ValueError("stop_regex must be a non-empty string or a list of non-empty strings")
        for pattern in self.stop_regex:
            try:
                compiled = stop_regex_pattern(pattern)
            except (_regex.error, RecursionError) as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
            if compiled.fullmatch(""):
                raise ValueError(f"stop_regex {pattern!r} matches the empty string")


def _normalise_bias(bias: Any) -> dict[int, float]:
    """logit_bias as {int id: float bias}; ids may be given as decimal strings (JSON object keys)."""
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be numbers between -100 and 100, got {value!r} "
                             f"for token {key}")
        out[token] = float(value)
    return out


@functools.lru_cache(maxsize=1024)
def stop_regex_pattern(pattern: str) -> "_regex.Pattern[str]":
    """Compiled once per pattern per process (validation and the engine's stop check share it)."""
    return _regex.compile(pattern)


def _check_int(p: SamplingParams, name: str, lo: int | None = None, hi: int | None = None) -> None:
    check_int(name, getattr(p, name), lo, hi)


def _check_float(p: SamplingParams, name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    setattr(p, name, check_number(name, getattr(p, name), lo, hi, lo_open))
