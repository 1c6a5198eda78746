"""One wording for every value check (engine config, sampling params, server config, HTTP fields).

    page_size must be >= 1, got 0
    temperature must be between 0 and 100, got 150
    top_p must be > 0 and <= 1, got 0
    n must be 1, got 2
    dtype must be one of auto, float32, bfloat16, float16, got 'fp8'

Pure Python (the HTTP process imports it; no torch).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .errors import RequestError


def fmt_number(value: Any) -> str:
    """1 for 1 and 1.0, 0.5 for 0.5; anything else as repr."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def describe_range(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> str:
    """'>= 1', '> 0', '<= 2', 'between 0 and 2' (inclusive), '> 0 and <= 1', '1'."""
    if lo is not None and hi is not None:
        if lo == hi and not lo_open:
            return fmt_number(lo)
        if lo_open:
            return f"> {fmt_number(lo)} and <= {fmt_number(hi)}"
        return f"between {fmt_number(lo)} and {fmt_number(hi)}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {fmt_number(lo)}"
    if hi is not None:
        return f"<= {fmt_number(hi)}"
    return "a number"


def in_range(value: float, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> bool:
    if lo is not None and (value <= lo if lo_open else value < lo):
        return False
    return hi is None or value <= hi


def range_message(name: str, value: Any, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False) -> str:
    return f"{name} must be {describe_range(lo, hi, lo_open)}, got {fmt_number(value)}"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """value if it is an int (not a bool) within [lo, hi]; else ValueError in the common wording."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not in_range(value, lo, hi):
        raise ValueError(range_message(name, value, lo, hi))
    return value


def check_number(name: str, value: Any, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False) -> float:
    """float(value) if it is a finite number within the range; else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not in_range(value, lo, hi, lo_open):
        raise ValueError(range_message(name, value, lo, hi, lo_open))
    return float(value)


def check_choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(choice_message(name, value, allowed))
    return value


def choice_message(name: str, value: Any, allowed: Sequence[str]) -> str:
    return f"{name} must be one of {', '.join(allowed)}, got {value!r}"


def token_id_list(prompt: Any, vocab: int) -> list[int]:
    """A non-text prompt as a list of token ids, each an int (not a bool) in [0, vocab), else a ValueError; int
    subclasses become plain ints, bytes are not token ids. The checks run over the whole list in C (type set,
    min, max: 2.7 ms for 64 prompts of 1088 tokens against 5.0 ms for a Python test per token); only a failure
    is located token by token, for the message."""
    not_ids = ValueError("prompt must be a string or a list of token ids")
    if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes, bytearray)):
        raise not_ids
    ids = list(prompt)
    if not ids:
        return ids
    kinds = set(map(type, ids))
    if kinds != {int} and not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise not_ids
    if min(ids) < 0 or max(ids) >= vocab:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return ids if kinds == {int} else [int(t) for t in ids]


MAX_SESSION_ID = 256


def check_session_id(session_id: Any, name: str = "session_id") -> str:
    """A session id (scheduler/sessions.py) or tenant name: a non-empty string of at most MAX_SESSION_ID characters."""
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID:
        raise ValueError(f"{name} must be a non-empty string of at most {MAX_SESSION_ID} characters")
    return session_id


def prompt_token_ids(prompt: Any, tokenizer: Any, vocab: int) -> list[int]:
    """A request's prompt as token ids: text encoded with the tokenizer, or ids checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    else:
        try:
            ids = token_id_list(prompt, vocab)
        except ValueError as exc:
            raise RequestError(str(exc), "prompt") from None
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    return ids


def check_request(prompt_ids: list[int], params: Any, context_length: int, vocab: int) -> None:
    """A request against an engine's limits (the server maps the RequestError's param to its API's name and answers
    400). The context never exceeds the KV pool (config.fit_context_to_pool), so a request within it fits the pool
    alone."""
    num, total = len(prompt_ids), len(prompt_ids) + params.max_new_tokens
    if num + min(params.max_new_tokens, 1) > context_length:  # the prompt's fault: no max_new_tokens fits
        raise RequestError(f"the prompt has {num} tokens, which leaves no room to generate in the context length "
                           f"{context_length}", "prompt", "context_length_exceeded")
    if total > context_length:
        raise RequestError(f"the prompt has {num} tokens and max_new_tokens is {params.max_new_tokens}: "
                           f"{total} exceeds the context length {context_length}", "max_new_tokens",
                           "context_length_exceeded")
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})", "logit_bias")
