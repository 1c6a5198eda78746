"""The grammar of tool calls the OpenAI layer makes the engine write (xgrammar structural tags).

Built here, in the HTTP process, as plain JSON (xgrammar imports torch, so it is compiled in the engine:
SamplingParams.structural_tag, scheduler/grammar.py). The call syntax is frontend/tool_parser's
``TOOL_CALL_SYNTAX``, the one the parser reads back, so a forced call always parses into ``tool_calls``:

- ``tool_choice: "required"``: one or more calls (``parallel_tool_calls`` false: exactly one), each to any
  of the tools, joined by the syntax's separator, and nothing else;
- ``tool_choice: {"type": "function", "function": {"name": N}}``: exactly one call to N;
- ``tool_choice: "auto"`` with some tool ``strict: true``: free text, but once the call tag is written the
  call must be to one of the tools, a strict tool's arguments matching its schema (the others' any
  JSON object).

Each call is ``call_prefix(name) <arguments JSON> call_suffix``; the arguments follow the function's
``parameters`` schema (an object of any shape when it has none), with at most one whitespace character
between JSON tokens (xgrammar's tightest setting here; a random model could otherwise pad forever).
Known gap: a string argument may contain the closing tag itself, where the parser would cut the call
(excluding it would cost the strings' length bounds in xgrammar 0.2.9).
"""
from __future__ import annotations

from typing import Any

from .structured import require as require_structured
from .tool_parser import TOOL_CALL_SYNTAX, ToolCallSyntax

ANY_OBJECT: dict[str, Any] = {"type": "object"}
_AUTO_INSTEAD = 'send tool_choice "auto" (the model may then answer without a call)'


def calls_grammar(tools: list[dict[str, Any]], named: str | None, forced: bool, parallel: bool, structured: bool,
                  what: str) -> tuple[dict[str, Any], bool] | None:
    """(structural tag, forced) of a tool choice, whatever the API that spelled it (OpenAI's tool_choice
    required / a named function / auto, Anthropic's any / tool / auto): exactly one call to `named`; or, when
    `forced`, one or more calls to any tool (exactly one unless `parallel`); or free text whose calls are
    constrained once begun when some tool is strict (None when none is, or without structured generation).
    A forced choice on a server without xgrammar is a 400 naming tool_choice (`what`: the choice, as the client
    sent it)."""
    if named is not None or forced:
        require_structured(structured, "tool_choice", what, _AUTO_INSTEAD)
        if named is not None:
            return forced_calls_tag(tools, [named], parallel=False), True
        return forced_calls_tag(tools, None, parallel=parallel), True
    tag = strict_calls_tag(tools) if structured else None
    return (tag, False) if tag is not None else None


def forced_calls_tag(tools: list[dict[str, Any]], names: list[str] | None, parallel: bool,
                     syntax: ToolCallSyntax = TOOL_CALL_SYNTAX) -> dict[str, Any]:
    """The structural tag of forced calls: to `names` only (None = any tool); several if parallel."""
    chosen = [t for t in tools if names is None or t["function"]["name"] in names]
    tags = [_call_tag(t["function"], syntax, strict=True) for t in chosen]
    if names is not None and len(names) == 1:
        return _structural(tags[0])
    return _structural({"type": "tags_with_separator", "tags": tags, "separator": syntax.separator,
                        "at_least_one": True, "stop_after_first": not parallel})


def strict_calls_tag(tools: list[dict[str, Any]], syntax: ToolCallSyntax = TOOL_CALL_SYNTAX
                     ) -> dict[str, Any] | None:
    """tool_choice auto: free text with calls constrained once begun; None when no tool is strict."""
    if not any(t["function"].get("strict") is True for t in tools):
        return None
    tags = [_call_tag(t["function"], syntax, strict=t["function"].get("strict") is True) for t in tools]
    return _structural({"type": "triggered_tags", "triggers": [syntax.open], "tags": tags,
                        "at_least_one": False, "stop_after_first": False})


def _call_tag(fn: dict[str, Any], syntax: ToolCallSyntax, strict: bool) -> dict[str, Any]:
    schema = fn.get("parameters") if strict else None
    if schema is None:
        schema = ANY_OBJECT
    return {"type": "tag", "begin": syntax.call_prefix(fn["name"]),
            # No "excludes" of the closing tag: xgrammar drops a string's min/maxLength when it filters.
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
            "end": syntax.call_suffix}


def _structural(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}
