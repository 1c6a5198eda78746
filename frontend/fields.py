"""Typed reads of JSON request fields: each bad value becomes a 400 naming the parameter."""
from __future__ import annotations

import math
from typing import Any

from .errors import bad_request, param_from_message
from .salt_policy import read_salt_after
from ..scheduler.checks import in_range, range_message
from ..scheduler.sampling_params import SamplingParams

_MISSING = object()
# Every stop string is searched for after each token, so the list is bounded (OpenAI allows 4).
MAX_STOP_STRINGS = 64
_MAX_EXACT_FLOAT_INT = 2**53


class FieldReader:
    """Reads fields of a JSON object; `prefix` makes nested names like `sampling_params.top_k`."""

    def __init__(self, body: Any, prefix: str = "") -> None:
        if not isinstance(body, dict):
            where = prefix.rstrip(".") or "body"
            raise bad_request(f"{where} must be a JSON object, got {_json_type(body)}", param=prefix.rstrip(".") or None)
        self.body = body
        self.prefix = prefix

    def name(self, key: str) -> str:
        return self.prefix + key

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.body.get(key, _MISSING)
        return default if value is _MISSING or value is None else value

    def has(self, key: str) -> bool:
        return self.body.get(key) is not None

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise bad_request(f"{self.name(key)} must be a boolean, got {_json_type(value)}", self.name(key))
        return value

    def int(self, key: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        value = self.raw(key, default)
        if value is None:
            return None
        # JSON integers past 64 bits arrive as floats, rounded: only exactly representable ones pass.
        if isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_EXACT_FLOAT_INT:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{self.name(key)} must be an integer, got {_json_type(value)}", self.name(key))
        _check_bounds(self.name(key), value, lo, hi)
        return value

    def number(self, key: str, default: float | None = None, lo: float | None = None,
               hi: float | None = None) -> float | None:
        value = self.raw(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"{self.name(key)} must be a number, got {_json_type(value)}", self.name(key))
        _check_bounds(self.name(key), float(value), lo, hi)
        return float(value)

    def str(self, key: str, default: str | None = None) -> str | None:
        value = self.raw(key, default)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{self.name(key)} must be a string, got {_json_type(value)}", self.name(key))
        return value

    def str_list(self, key: str, max_len: int | None = None) -> list[str]:
        """A string or a list of strings (as `stop` accepts); empty strings are refused."""
        value = self.raw(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad_request(f"{self.name(key)} must be a string or a list of strings", self.name(key))
        if any(v == "" for v in value):
            raise bad_request(f"{self.name(key)} must not contain empty strings", self.name(key))
        check_list_len(self.name(key), value, max_len)
        return list(value)

    def int_list(self, key: str, lo: int = 0) -> list[int]:
        value = self.raw(key, [])
        if not isinstance(value, list) or not all(_is_int(v) and v >= lo for v in value):
            raise bad_request(f"{self.name(key)} must be a list of integers >= {lo}", self.name(key))
        return list(value)

    def obj(self, key: str) -> "FieldReader | None":
        value = self.raw(key)
        if value is None:
            return None
        return FieldReader(value, prefix=self.name(key) + ".")

    def choice(self, key: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.str(key, default)
        if value not in allowed:
            raise bad_request(f"{self.name(key)} must be one of {', '.join(allowed)}, got {value!r}",
                              self.name(key))
        return value


# SamplingParams field -> the OpenAI-side name (the extensions keep their own names).
OPENAI_SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "logprobs": "logprobs",
    "logprob_start_len": "logprob_start_len",
    "cache_salt": "cache_salt",
    "cache_salt_after": "cache_salt_after",
    "session_id": "session_id",
    "priority": "priority",
    "skip_special_tokens": "skip_special_tokens",
    "json_schema": "response_format",
    "structural_tag": "tools",  # built from tools + tool_choice (frontend/tool_grammar.py)
    "logit_bias": "logit_bias",
}


def read_openai_sampling(reader: FieldReader) -> dict[str, Any]:
    """The SamplingParams keyword arguments an OpenAI request carries (no max/seed/logprobs)."""
    kwargs: dict[str, Any] = {
        "temperature": reader.number("temperature", 1.0, lo=0.0),
        "top_p": reader.number("top_p", 1.0),
        "top_k": reader.int("top_k", -1),
        "min_p": reader.number("min_p", 0.0),
        "frequency_penalty": reader.number("frequency_penalty", 0.0),
        "presence_penalty": reader.number("presence_penalty", 0.0),
        "repetition_penalty": reader.number("repetition_penalty", 1.0),
        "min_new_tokens": reader.int("min_tokens", 0, lo=0),
        "ignore_eos": reader.bool("ignore_eos", False),
        "stop": reader.str_list("stop", MAX_STOP_STRINGS),
        "stop_token_ids": reader.int_list("stop_token_ids"),
        "cache_salt": reader.str("cache_salt"),
        # A count, or the name of the system boundary (resolved per prompt by frontend/salt_policy.py).
        "cache_salt_after": read_salt_after(reader.raw("cache_salt_after"), reader.name("cache_salt_after")),
        "session_id": reader.str("session_id"),
        "priority": reader.int("priority", 0, lo=-(2**31), hi=2**31 - 1) or 0,  # vLLM's: lower runs first
        "skip_special_tokens": reader.bool("skip_special_tokens", True),
    }
    if kwargs["top_k"] == 0:
        kwargs["top_k"] = -1  # OpenAI-style clients send 0 for "off"
    return kwargs


def make_sampling_params(kwargs: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """Builds SamplingParams; its ValueError becomes a 400 naming the client's parameter. A cache_salt_after named
    by its boundary ("system") stands for a count here: the count comes with the prompt (salt_policy.resolve_salt)."""
    if isinstance(kwargs.get("cache_salt_after"), str):
        kwargs = dict(kwargs, cache_salt_after=0)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = param_from_message(message, names)
        if param is not None and param != message.split(" ", 1)[0]:
            internal = next((k for k, v in names.items() if v == param), None)
            if internal and message.startswith(internal):
                message = param + message[len(internal):]
        raise bad_request(message, param) from exc


def check_list_len(name: str, value: Any, max_len: int | None) -> None:
    if max_len is not None and isinstance(value, list) and len(value) > max_len:
        raise bad_request(f"{name} has {len(value)} entries; at most {max_len} are allowed", name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bounds(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if not in_range(value, lo, hi):
        raise bad_request(range_message(name, value, lo, hi), name)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
