"""The `serve` flags: one per field of ServerConfig, EngineConfig and PolicyConfig, read from the dataclass fields
(`option(...)` in scheduler/config.py), so a new engine setting is a flag without touching this file:

    ServerConfig.port                       --port
    ServerConfig.engine.page_size           --page-size          (engine fields are top-level flags)
    ServerConfig.engine.policy.window       --policy-window      (other nested configs: prefixed)

config_from_args parses them into the config and config_argv writes a config back as flags (replica workers).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any, Iterator

from .config import ServerConfig

_UNPREFIXED = ("engine",)  # nested configs whose fields are flags without a prefix
_DERIVED = ("engine.model_path",)  # set from another field (ServerConfig.model), never a flag


@dataclasses.dataclass(frozen=True)
class _Flag:
    path: tuple[str, ...]  # field names from ServerConfig down, e.g. ("engine", "policy", "window")
    dest: str  # argparse dest, e.g. "policy_window"
    field: dataclasses.Field
    hint: Any


def config_flags() -> list[_Flag]:
    """Every flag of `serve`, in field order; fails loudly on a missing help text or a clash."""
    flags = list(_walk(ServerConfig, (), ""))
    dests = [f.dest for f in flags]
    clashes = sorted({d for d in dests if dests.count(d) > 1})
    if clashes:
        raise AssertionError(f"config fields give the same flag twice: {', '.join(clashes)}")
    missing = [".".join(f.path) for f in flags if not f.field.metadata.get("help")]
    if missing:
        raise AssertionError(f"config fields without help text (use option(...)): {', '.join(missing)}")
    return flags


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The nested config from parsed flags (each dataclass validates its own fields)."""
    dests = {flag.path: flag.dest for flag in config_flags()}
    return _build(ServerConfig, (), {path: getattr(args, dest) for path, dest in dests.items()})


def config_argv(config: ServerConfig) -> list[str]:
    """The `serve` flags that rebuild `config` (fields left at their defaults are not named); the
    inverse of config_from_args, used to start replica workers (frontend/replicas.py)."""
    argv: list[str] = []
    for flag in config_flags():
        value: Any = config
        for name in flag.path:
            value = getattr(value, name)
        if value == flag.field.default or value is None:
            continue
        name = flag_name(flag)
        if _base_type(flag.hint) is bool:
            argv.append(name if value else "--no-" + name[2:])
        else:
            argv += [name, str(value)]
    return argv


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Every config flag on `parser`, one argument group per nested config."""
    groups: dict[tuple[str, ...], Any] = {}
    for flag in config_flags():
        owner = flag.path[:-1]
        if owner not in groups:
            title = (".".join(owner) or "server") + " settings"
            groups[owner] = parser.add_argument_group(title, _field(owner).metadata.get("help") if owner else None)
        _add_flag(groups[owner], flag)


def _walk(cls: type, path: tuple[str, ...], prefix: str) -> Iterator[_Flag]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub_path = path + (f.name,)
        if ".".join(sub_path) in _DERIVED:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            sub_prefix = prefix if f.name in _UNPREFIXED else f"{prefix}{f.name}_"
            yield from _walk(hints[f.name], sub_path, sub_prefix)
        else:
            yield _Flag(sub_path, prefix + f.name, f, hints[f.name])


def _field(path: tuple[str, ...]) -> dataclasses.Field:
    cls: Any = ServerConfig
    for name in path:
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        cls = typing.get_type_hints(cls)[name]
    return f


def _build(cls: type, path: tuple[str, ...], values: dict[tuple[str, ...], Any]) -> Any:
    """cls(...) from flag values keyed by field path; nested configs built first, derived fields left out."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        sub_path = path + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], sub_path, values)
        elif sub_path in values:
            kwargs[f.name] = values[sub_path]
    return cls(**kwargs)


def _add_flag(group: Any, flag: _Flag) -> None:
    meta = flag.field.metadata
    name = flag_name(flag)
    default = None if flag.field.default is dataclasses.MISSING else flag.field.default
    base = _base_type(flag.hint)
    if base is bool:
        group.add_argument(name, dest=flag.dest, action=argparse.BooleanOptionalAction, default=default,
                           help=meta["help"])
        return
    choices = meta.get("choices")
    group.add_argument(name, *meta.get("aliases", ()), dest=flag.dest, type=base, default=default, choices=choices,
                       metavar=None if choices else name[2:].replace("-", "_").upper(), help=meta["help"])


def flag_name(flag: _Flag) -> str:
    """--page-size for engine.page_size (or the field's own `flag`)."""
    return flag.field.metadata.get("flag") or "--" + flag.dest.replace("_", "-")


def _base_type(hint: Any) -> type:
    """int from `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def with_flag_names(message: str) -> str:
    """'page_size must be >= 1, ...' -> '--page-size must be >= 1, ...': the settings a message names, as the flags
    the user typed (its first word, and any snake_case setting further on: "raise kv_cache_tokens to ...")."""
    flags: dict[str, str] = {}
    for flag in config_flags():
        for name in (flag.dest, ".".join(flag.path), ".".join(flag.path[1:]) if flag.path[0] in _UNPREFIXED else ""):
            flags[name] = flag_name(flag)
    flags.pop("", None)
    head, sep, rest = message.partition(" ")
    rest = _SNAKE_CASE.sub(lambda m: flags.get(m.group(0), m.group(0)), rest)
    return flags.get(head, head) + sep + rest


_SNAKE_CASE = re.compile(r"(?<![\w/.-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/.-])")
