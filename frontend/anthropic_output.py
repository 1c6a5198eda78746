"""A Messages answer's content blocks, built from the engine's text as it comes: the same builder serves the stream
(its events are Anthropic's `content_block_start` / `content_block_delta` / `content_block_stop` payloads) and the
whole message (its `blocks`), so both carry the same content.

The text goes through the reasoning splitter (frontend/reasoning.py, with `--reasoning-parser`) into `thinking`
blocks, closed with their signature (frontend/thinking_signature.py; a `signature_delta` in a stream), and the answer
through chat's tool-call parser (frontend/tool_parser.py) into `text` and `tool_use` blocks; a call's input is
streamed as one `input_json_delta`. A call whose arguments are not a JSON object stays text, as the parser keeps
what it cannot read.
"""
from __future__ import annotations

import json
from typing import Any

from .reasoning import ReasoningSplitter, split_output
from .thinking_signature import sign
from .tool_parser import TOOL_CALL_SYNTAX, StreamingToolParser, ToolCall
from ..scheduler.req import GenerateResult

_START = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTA = {"text": "text_delta", "thinking": "thinking_delta"}


class MessageContent:
    """feed(text, num_tokens) and finish(cut) return stream events (payloads); `blocks` is the content so far."""

    def __init__(self, splitter: ReasoningSplitter | None, tools: bool, key: bytes, single_call: bool) -> None:
        self.splitter = splitter
        self.parser = StreamingToolParser() if tools else None
        self.key = key
        self.single_call = single_call
        self.blocks: list[dict[str, Any]] = []
        self.num_calls = 0
        self._open: str | None = None  # the kind of the block being written ("text" or "thinking")

    def feed(self, text: str, num_tokens: int = 0) -> list[dict[str, Any]]:
        reasoning, answer = self.splitter.feed(text, num_tokens) if self.splitter is not None else ("", text)
        return self._reasoning(reasoning) + self._answer(self.parser.feed(answer) if self.parser else
                                                         [("content", answer)])

    def finish(self, cut: bool) -> list[dict[str, Any]]:
        """The rest, once the output ended (`cut`: before the model ended it; an unfinished call is dropped)."""
        reasoning, answer = self.splitter.finish() if self.splitter is not None else ("", "")
        return self._end(reasoning, answer, cut)

    def whole(self, r: GenerateResult, tokenizer: Any) -> None:
        """A finished result at once (the reasoning tokens counted exactly, as split_output counts them)."""
        if self.splitter is None:
            self._end("", r.text, r.cut_short)
        else:
            self._end(*split_output(self.splitter, r.text, r.output_ids, tokenizer), r.cut_short)

    @property
    def thinking_tokens(self) -> int | None:
        """The output's reasoning tokens; None without a reasoning parser."""
        return self.splitter.reasoning_tokens if self.splitter is not None else None

    def _end(self, reasoning: str, answer: str, cut: bool) -> list[dict[str, Any]]:
        events = self._reasoning(reasoning)
        pieces = [("content", answer)]
        if self.parser is not None:
            pieces = self.parser.feed(answer) + self.parser.finish(cut)
        return events + self._answer(pieces) + self._close()

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._write("thinking", text) if text else []

    def _answer(self, pieces: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, value in pieces:
            if kind == "content":
                events += self._write("text", value) if value else []
            else:
                events += self._tool_use(value)
        return events

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open != kind:
            events += self._close() + self._start(dict(_START[kind]))
            self._open = kind
        self.blocks[-1][kind] += text
        events.append(self._delta({"type": _DELTA[kind], kind: text}))
        return events

    def _tool_use(self, call: ToolCall) -> list[dict[str, Any]]:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):  # not a tool_use Anthropic could carry: kept as the text it was
            return self._write("text", TOOL_CALL_SYNTAX.render(call.name, call.arguments))
        if self.single_call and self.num_calls:
            return []  # disable_parallel_tool_use: the first call only
        self.num_calls += 1
        block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name}
        events = self._close() + self._start(dict(block, input={}))
        self.blocks[-1]["input"] = arguments
        events.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(arguments)}))
        return events + self._close(force=True)

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self, force: bool = False) -> list[dict[str, Any]]:
        if self._open is None and not force:
            return []
        events = []
        if self._open == "thinking":
            signature = self.blocks[-1]["signature"] = sign(self.key, self.blocks[-1]["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": signature}))
        self._open = None
        return events + [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def stop_reason(r: GenerateResult, made_calls: bool, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): max_tokens when cut by the limit (or the context), tool_use when the answer
    made calls and ended on its own, stop_sequence when one of the request's stop strings matched, else end_turn
    (EOS, a stop token, and an abort asked for with /abort_request)."""
    if r.finish_reason == "length":
        return "max_tokens", None
    if made_calls and not r.cut_short:
        return "tool_use", None
    if isinstance(r.matched_stop, str) and r.matched_stop in stops:
        return "stop_sequence", r.matched_stop
    return "end_turn", None


def message_usage(prompt_tokens: int, r: GenerateResult | None, thinking_tokens: int | None = None
                  ) -> dict[str, Any]:
    """Anthropic's usage: the prompt is input_tokens (computed) + cache_read_input_tokens (the radix cache's hits);
    nothing is billed as a cache write (cache_creation_input_tokens 0): every prompt is cached anyway.
    `thinking_tokens` (with a reasoning parser): output_tokens_details.thinking_tokens."""
    cached = r.cached_tokens if r is not None else 0
    usage = {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": cached, "output_tokens": r.completion_tokens if r is not None else 0}
    if thinking_tokens is not None:
        usage["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return usage
