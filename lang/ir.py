"""The expressions a program appends to its state: text, roles, gen and select.

`s += expr` queues an expression; the state's executor runs them in order against a backend.
Expressions compose with `+` (`"Answer: " + gen("a")`), and role helpers wrap any of them.

Structured gens (SGLang's names): `gen(name, regex=...)`, `gen(name, json_schema=...)` (a dict or a
JSON string) and typed gens `gen(name, dtype=int|float|bool|str)` / `gen_int` / `gen_string`, which
constrain the output with one of TYPE_REGEXES. As in SGLang, `s[name]` is the generated text; the
typed value (int, float, bool, or the str between the quotes) is `s.get_typed(name)`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

ROLES = ("system", "user", "assistant")
SELECT_METHODS = ("sum", "normalized")

# The regexes of typed gens. Each is bounded in length, so the grammar ends (the model must then
# stop) within a few dozen tokens: int up to 18 digits, float up to 16 + 15 digits (no exponent),
# bool as Python spells it (SGLang's choice), str a double-quoted string of up to 64 characters
# with no backslash, quote or newline inside (so its value is the text between the quotes).
TYPE_REGEXES = {
    "int": r"-?(0|[1-9][0-9]{0,17})",
    "float": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]{0,64}"',
}
_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}


class Expr:
    """Base of all DSL expressions; `+` builds a sequence."""

    def __add__(self, other: "Expr | str") -> "Seq":
        return Seq([self, as_expr(other)])

    def __radd__(self, other: "Expr | str") -> "Seq":
        return Seq([as_expr(other), self])


@dataclass
class Text(Expr):
    text: str


@dataclass
class Seq(Expr):
    items: list[Expr]


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class Gen(Expr):
    name: str | None
    # Sampling overrides; None means "use the program's defaults" (see program.run).
    params: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None  # "int" | "float" | "bool" | "str": a typed gen (params carry its regex)


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    method: str = "sum"


def as_expr(value: "Expr | str") -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append a {type(value).__name__} to a program state; use a str or a DSL expression")


def flatten(expr: Expr) -> list[Expr]:
    """Sequences and role wrappers as one flat list of primitive expressions."""
    if isinstance(expr, Seq):
        out: list[Expr] = []
        for item in expr.items:
            out.extend(flatten(item))
        return out
    return [expr]


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    stop_token_ids: Sequence[int] | None = None,
    min_tokens: int | None = None,
    seed: int | None = None,
    choices: Sequence[str] | None = None,
    dtype: type | str | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
) -> Expr:
    """Generate text into variable `name`. With `choices`, the same as `select(name, choices)`.

    At most one constraint: `regex` (the engine's regex syntax; an invalid one is the engine's
    error, a BackendError naming this gen), `json_schema` (a dict or a JSON string), or `dtype`
    (int, float, bool or str, or their names: the output matches TYPE_REGEXES[dtype] and
    `s.get_typed(name)` converts it)."""
    label = f"gen({name!r})" if name else "gen"
    given = [k for k, v in (("choices", choices), ("dtype", dtype), ("regex", regex),
                            ("json_schema", json_schema)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{label}: {' and '.join(given)} cannot be used together; pass one of them")
    if choices is not None:
        return select(name, choices)
    if regex is not None and (not isinstance(regex, str) or not regex):
        raise ValueError(f"{label}: regex must be a non-empty string, got {regex!r}")
    if json_schema is not None and not (isinstance(json_schema, dict) or (isinstance(json_schema, str)
                                                                           and json_schema)):
        raise ValueError(f"{label}: json_schema must be a dict or a non-empty JSON string, got {json_schema!r}")
    dtype_name = _dtype_name(dtype, label) if dtype is not None else None
    if dtype_name is not None:
        regex = TYPE_REGEXES[dtype_name]
    params = {
        "max_new_tokens": max_tokens,
        "stop": [stop] if isinstance(stop, str) else (list(stop) if stop is not None else None),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "repetition_penalty": repetition_penalty,
        "ignore_eos": ignore_eos,
        "stop_token_ids": list(stop_token_ids) if stop_token_ids is not None else None,
        "min_new_tokens": min_tokens,
        "seed": seed,
        "regex": regex,
        "json_schema": json_schema,
    }
    return Gen(name=name, params={k: v for k, v in params.items() if v is not None}, dtype=dtype_name)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """`gen(name, dtype=int, ...)` (SGLang's name): an integer, read back with `s.get_typed(name)`."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """`gen(name, dtype=str, ...)` (SGLang's name): a double-quoted string; `s.get_typed(name)` is its content."""
    return gen(name, dtype=str, **kwargs)


def convert_typed(dtype: str, text: str) -> Any:
    """The value of a typed gen's text; ValueError if the text does not match TYPE_REGEXES[dtype]
    (e.g. cut off by max_tokens)."""
    if re.fullmatch(TYPE_REGEXES[dtype], text) is None:
        raise ValueError(f"{text!r} is not a complete {dtype} (the pattern {TYPE_REGEXES[dtype]})")
    if dtype == "int":
        return int(text)
    if dtype == "float":
        return float(text)
    if dtype == "bool":
        return text == "True"
    return text[1:-1]


def _dtype_name(dtype: Any, label: str) -> str:
    name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype) if isinstance(dtype, type) else None
    if name not in TYPE_REGEXES:
        raise ValueError(f"{label}: dtype must be one of int, float, bool, str (or their names), got {dtype!r}")
    return name


def select(name: str | None = None, choices: Iterable[str] = (), method: str = "sum") -> Expr:
    """Append the choice the model scores highest, by the logprobs of its tokens after the prefix.

    method "sum" adds the choice's token logprobs; "normalized" divides by its token count.
    """
    choices = list(choices)
    if not choices:
        raise ValueError("select needs at least one choice")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select choices must be non-empty strings")
    if method not in SELECT_METHODS:
        raise ValueError(f"select method must be one of {SELECT_METHODS}, got {method!r}")
    return Select(name=name, choices=choices, method=method)


def _role(role: str, content: "Expr | str") -> Expr:
    return Seq([RoleBegin(role), as_expr(content), RoleEnd(role)])


def system(content: "Expr | str") -> Expr:
    return _role("system", content)


def user(content: "Expr | str") -> Expr:
    return _role("user", content)


def assistant(content: "Expr | str") -> Expr:
    return _role("assistant", content)
