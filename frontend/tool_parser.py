"""Tool calls in generated text: the `<tool_call>{json}</tool_call>` convention (Qwen / Hermes templates).

``TOOL_CALL_SYNTAX`` is the one definition of that syntax (the tags, the body's JSON shape, what
separates consecutive calls, as the test checkpoints' chat template renders them): this parser reads
it, and frontend/tool_grammar.py builds the grammar of forced calls (tool_choice required / named)
from it, so what the engine is made to write is what this parser reads back.

The streaming parser sees text deltas and releases content as soon as it cannot be the start of a
tool call; a complete `<tool_call>...</tool_call>` block becomes one ToolCall. A block whose body
is not `{"name": ..., "arguments": ...}` JSON stays content, so nothing the model wrote is lost.
An unterminated block stays content too, unless the generation was cut (max_tokens, an abort): then it is a
call the model had no room to finish, dropped (the finish reason says why), not returned as raw markup.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class ToolCallSyntax:
    """How a chat template writes one call: ``open + {"name": NAME, "arguments": ARGS} + close``,
    consecutive calls joined by ``separator``."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    separator: str = ""

    def call_prefix(self, name: str) -> str:
        """The text of a call to `name` up to its arguments' JSON."""
        return self.open + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '

    @property
    def call_suffix(self) -> str:
        """The text after the arguments' JSON."""
        return "}" + self.close

    def render(self, name: str, arguments_json: str) -> str:
        return self.call_prefix(name) + arguments_json + self.call_suffix


TOOL_CALL_SYNTAX = ToolCallSyntax()
TOOL_CALL_OPEN = TOOL_CALL_SYNTAX.open
TOOL_CALL_CLOSE = TOOL_CALL_SYNTAX.close


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI returns it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


class StreamingToolParser:
    """feed(delta) -> events; an event is ("content", text) or ("tool_call", ToolCall)."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self._held_space = ""  # whitespace-only content: dropped if a tool call follows it directly
        self.names: list[str] = []  # the tools called so far

    @property
    def num_calls(self) -> int:
        return len(self.names)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        events: list[tuple[str, Any]] = []
        while True:
            if self._in_call:
                end = self._pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return events
                body = self._pending[:end]
                self._pending = self._pending[end + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                call = parse_tool_call_body(body)
                if call is None:
                    self._content(events, TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                else:
                    self._held_space = ""
                    self.names.append(call.name)
                    events.append(("tool_call", call))
                continue
            start = self._pending.find(TOOL_CALL_OPEN)
            if start >= 0:
                self._content(events, self._pending[:start])
                self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
                self._in_call = True
                continue
            keep = _partial_prefix_len(self._pending, TOOL_CALL_OPEN)
            self._content(events, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return events

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """Flushes what is left: an unterminated tool call (or the start of its tag, all that is ever held
        outside one) is returned as content, or dropped if `cut` (the generation ended before the model did:
        finish_reason length or abort)."""
        events: list[tuple[str, Any]] = []
        rest = "" if cut else (TOOL_CALL_OPEN if self._in_call else "") + self._pending
        self._pending, self._in_call = "", False
        self._content(events, rest)
        if self._held_space and self.num_calls == 0:
            events.append(("content", self._held_space))
        self._held_space = ""
        return events

    def _content(self, events: list[tuple[str, Any]], text: str) -> None:
        # Trailing whitespace waits: it is dropped if a tool call follows directly, so the
        # result does not depend on how the text was split into deltas.
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        if body:
            events.append(("content", body))


def parse_tool_calls(text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """Whole-text parse: (content, tool calls). With calls, content is stripped and None if empty. `cut`: as
    StreamingToolParser.finish's."""
    parser = StreamingToolParser()
    events = parser.feed(text) + parser.finish(cut)
    content = "".join(value for kind, value in events if kind == "content")
    calls = [value for kind, value in events if kind == "tool_call"]
    if calls:
        content = content.strip() or None
    return content, calls


def parse_tool_call_body(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body, strict=False)  # raw control characters in strings (xgrammar allows them)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"], arguments=arguments)


def _partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
