"""Parsing of SGLang-native `/generate` bodies (`text` or `input_ids`, one or a batch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .fields import MAX_STOP_STRINGS, FieldReader, check_list_len, make_sampling_params
from .sessions_api import native_session
from .structured import require as require_structured
from ..scheduler.sampling_params import SamplingParams

# SGLang clients (RuntimeEndpoint) send these; they are accepted and have no effect here.
_IGNORED_KEYS = frozenset({"stream_interval", "custom_params", "dtype"})
# Constrained decoding keys not supported yet: accepted only when unset (regex, json_schema and
# ebnf are SamplingParams fields, compiled by the engine).
_CONSTRAINT_KEYS = frozenset({"structural_tag", "logit_bias"})
_GRAMMAR_KEYS = ("regex", "json_schema", "ebnf")  # need xgrammar in the engine (frontend/structured.py)
# SamplingParams fields the server sets and a client may not: the tenant comes from the API key; priority is a
# top-level field of /generate (SGLang's GenerateReqInput.priority).
_SERVER_FIELDS = frozenset({"tenant", "priority"})


@dataclass(frozen=True)
class NativeItem:
    prompt: str | list[int]
    sampling: dict[str, Any]  # SamplingParams kwargs, validated
    n: int  # results for this prompt (SGLang's sampling_params.n); choice i samples with seed + i
    rid: str | None
    return_logprob: bool
    logprob_start_len: int  # -1 = only output logprobs (SGLang's default)
    top_logprobs_num: int
    return_text_in_logprobs: bool


@dataclass(frozen=True)
class NativeRequest:
    items: list[NativeItem]
    is_batch: bool
    stream: bool


def parse_generate_request(body: Any, max_n: int = 1, structured: bool = True) -> NativeRequest:
    """A /generate body; `sampling_params.n` may be up to max_n (the server's --max-n); `structured`: the engine
    can compile grammars."""
    reader = FieldReader(body)
    prompts, is_batch = _parse_inputs(reader)
    num = len(prompts)
    sampling = _per_item(reader, "sampling_params", num, is_batch, {})
    rids = _per_item(reader, "rid", num, is_batch, None)
    return_logprob = _per_item(reader, "return_logprob", num, is_batch, False)
    start_lens = _per_item(reader, "logprob_start_len", num, is_batch, -1)
    top_nums = _per_item(reader, "top_logprobs_num", num, is_batch, 0)
    text_in_logprobs = reader.bool("return_text_in_logprobs", False)
    stream = reader.bool("stream", False)
    session_id = native_session(body)
    priority = reader.int("priority", 0, lo=-(2**31), hi=2**31 - 1) or 0
    items = []
    for i, prompt in enumerate(prompts):
        where = f"[{i}]" if is_batch else ""
        kwargs, n = _parse_sampling(sampling[i], where, max_n, structured)
        if session_id is not None:
            kwargs["session_id"] = session_id
        if priority:
            kwargs["priority"] = priority
        items.append(NativeItem(
            prompt=prompt,
            sampling=kwargs,
            n=n,
            rid=_check_type(rids[i], str, "rid" + where, "a string", optional=True),
            return_logprob=_check_type(return_logprob[i], bool, "return_logprob" + where, "a boolean"),
            logprob_start_len=_check_int(start_lens[i], "logprob_start_len" + where, lo=-1),
            top_logprobs_num=_check_int(top_nums[i], "top_logprobs_num" + where, lo=0, hi=20),
            return_text_in_logprobs=text_in_logprobs,
        ))
    rid_list = [item.rid for item in items if item.rid is not None]
    if len(set(rid_list)) != len(rid_list):
        raise bad_request("rid values must be unique within a batch", "rid")
    return NativeRequest(items=items, is_batch=is_batch, stream=stream)


def _parse_inputs(reader: FieldReader) -> tuple[list[str | list[int]], bool]:
    text, input_ids = reader.raw("text"), reader.raw("input_ids")
    if (text is None) == (input_ids is None):
        raise bad_request("exactly one of text and input_ids is required", "text")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise bad_request("text must be a string or a non-empty list of strings", "text")
    if isinstance(input_ids, list) and input_ids:
        if all(_is_id(t) for t in input_ids):
            return [list(input_ids)], False
        if all(isinstance(p, list) and p and all(_is_id(t) for t in p) for p in input_ids):
            return [list(p) for p in input_ids], True
    raise bad_request("input_ids must be a non-empty list of token ids (non-negative integers) "
                      "or a list of such lists", "input_ids")


def _per_item(reader: FieldReader, key: str, num: int, is_batch: bool, default: Any) -> list[Any]:
    """A field given once (applies to all) or, for a batch, as a list with one value per prompt."""
    value = reader.raw(key, default)
    if not isinstance(value, list):
        return [value] * num
    if not is_batch or len(value) != num:
        raise bad_request(f"{key} as a list needs a batch with one entry per prompt ({num})", key)
    return list(value)


def _parse_sampling(raw: Any, where: str, max_n: int, structured: bool) -> tuple[dict[str, Any], int]:
    """SamplingParams kwargs and n. A null value means unset, for every key (SGLang's
    SglSamplingParams sends most keys, many as null); unknown keys are a 400 naming them."""
    name = "sampling_params" + where
    reader = FieldReader(raw, prefix=name + ".")
    n = reader.int("n", 1, lo=1, hi=max_n)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "n" or key in _IGNORED_KEYS:
            continue
        field_name = "seed" if key == "sampling_seed" else key
        known = field_name in SamplingParams.__dataclass_fields__ and field_name not in _SERVER_FIELDS
        if not known and key not in _CONSTRAINT_KEYS:
            raise bad_request(f"unknown sampling parameter {name}.{key}", f"{name}.{key}")
        if value is None:  # unset: the one place the native API decides it
            continue
        if key in _CONSTRAINT_KEYS:
            if value:
                raise bad_request(f"{name}.{key} needs constrained decoding, which is not supported",
                                  f"{name}.{key}", code="unsupported_parameter")
            continue
        if key in ("stop", "stop_regex"):
            check_list_len(f"{name}.{key}", value, MAX_STOP_STRINGS)
        if key in _GRAMMAR_KEYS:
            require_structured(structured, f"{name}.{key}", f"{name}.{key}")
        kwargs[field_name] = value
    if kwargs.get("top_k") == 0:
        kwargs["top_k"] = -1
    names = {k: f"{name}.{k}" for k in SamplingParams.__dataclass_fields__}
    make_sampling_params(kwargs, names)
    return kwargs, n


def _check_type(value: Any, kind: type, name: str, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, kind):
        raise bad_request(f"{name} must be {what}", name)
    return value


def _check_int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        upper = hi if hi is not None else "inf"
        raise bad_request(f"{name} must be an integer in [{lo}, {upper}], got {value!r}", name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id(value: Any) -> bool:
    return _is_int(value) and value >= 0
