"""The expressions a program appends to its state: text, roles, gen and select.

`s += expr` queues an expression; the state's executor runs them in order against a backend.
Expressions compose with `+` (`"Answer: " + gen("a")`), and role helpers wrap any of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

ROLES = ("system", "user", "assistant")
SELECT_METHODS = ("sum", "normalized")


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
) -> Expr:
    """Generate text into variable `name`. With `choices`, the same as `select(name, choices)`."""
    if choices is not None:
        return select(name, choices)
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
    }
    return Gen(name=name, params={k: v for k, v in params.items() if v is not None})


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
