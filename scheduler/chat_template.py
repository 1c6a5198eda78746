"""Chat templates rendered with jinja2 alone (no transformers, so no torch), the way transformers renders them.

Where a checkpoint keeps its templates (transformers' precedence): ``chat_template.jinja`` (the default template) and
``additional_chat_templates/<name>.jinja`` (named ones), as transformers 5 saves them, when present; else
tokenizer_config.json's ``chat_template``, a string or a list of ``{"name", "template"}``. With several templates,
``tool_use`` is picked when tools are passed and ``default`` otherwise.

Rendering follows transformers' apply_chat_template(tokenize=False): a sandboxed, immutable jinja environment with
trim_blocks and lstrip_blocks, the loopcontrols extension and a pass-through ``{% generation %}`` tag; the globals
raise_exception, strftime_now, a restricted dict and namespace; a tojson filter that does not escape HTML. Messages
lose their None-valued keys, reasoning given as reasoning_content/thinking/reasoning is visible under the first two
names, and everything the template sees is rebuilt from plain JSON-like values. The template reads messages, tools,
documents, add_generation_prompt, the named special tokens (bos_token, eos_token, ...) and any extra keyword.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def load_chat_templates(path: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The checkpoint's chat template: one string, a dict of named templates, or None."""
    found: dict[str, str] = {}
    default_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(default_file):
        found["default"] = _read_text(default_file)
    named_dir = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(named_dir):
        for name in sorted(os.listdir(named_dir)):
            if name.endswith(".jinja"):
                found[name[: -len(".jinja")]] = _read_text(os.path.join(named_dir, name))
    if found:
        return found["default"] if list(found) == ["default"] else found
    value = config.get("chat_template")
    if isinstance(value, (list, tuple)):
        return {item["name"]: item["template"] for item in value}
    return value if isinstance(value, str) else None


def select_template(templates: str | dict[str, str] | None, tools: Any, requested: str | None = None) -> str:
    """The template source to render: `requested` (a template name or a template's own source) wins."""
    if isinstance(templates, dict):
        if requested is not None:
            return templates.get(requested, requested)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"several chat templates ({', '.join(sorted(templates))}) and none named 'default'; "
                         "pass chat_template=<name>")
    if requested is not None:
        return requested
    if not templates:
        raise ValueError("no chat template")
    return templates


class ChatRenderer:
    """Compiles each template source once; rendering is thread-safe (jinja templates are)."""

    def __init__(self) -> None:
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self._lock = threading.Lock()

    def render(self, source: str, messages: list[Any], tools: list[Any] | None, add_generation_prompt: bool,
               variables: Mapping[str, Any]) -> str:
        """`variables` are the special tokens and the caller's template keywords (which win over them)."""
        template = self._compiled.get(source)
        if template is None:
            with self._lock:
                template = self._compiled.get(source)
                if template is None:
                    template = self._compiled[source] = self._env.from_string(source)
        chat = [_with_reasoning_aliases(message) for message in _plain(_normalized_messages(messages))]
        context = {"documents": None, **_plain(dict(variables))}
        context.update(messages=chat, tools=_plain(tools), add_generation_prompt=add_generation_prompt)
        return template.render(**context)


# ---------------------------------------------------------------------------------------------------------------


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _normalized_messages(messages: Any) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        # APIs send content=None / tool_calls=None; templates handle a missing key better than a None value.
        out.append({key: value for key, value in message.items() if value is not None})
    return out


def _with_reasoning_aliases(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """A copy made of plain values only: the sandbox cannot vouch for the methods of arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)) and type(value).__module__ == "numpy":
        return _plain(value.item())
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore-prefixed attribute names (a way towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the namespace attribute {name!r}")


class _DictFactory:
    """dict(...) and dict.fromkeys(...) for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictFactory(),
                       namespace=_SafeNamespace)
    return env
