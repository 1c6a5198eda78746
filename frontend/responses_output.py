"""A response's output items and its stream of events, built from the engine's text deltas.

One builder serves both paths: it turns text into output items (with a reasoning parser, a `reasoning` item
first, its text split off by frontend/reasoning.py; then a `message` with one `output_text` part, and a
`function_call` item per tool call parsed in the answer, in the order the model wrote them) and returns, for
each step, the events of OpenAI's streaming sequence:

    response.created, response.in_progress,
      response.output_item.added, response.content_part.added, response.reasoning_text.delta ...,
      response.reasoning_text.done, response.content_part.done, response.output_item.done    (reasoning)
      response.output_item.added, response.content_part.added, response.output_text.delta ...,
      response.output_text.done, response.content_part.done, response.output_item.done        (a message)
      response.output_item.added, response.function_call_arguments.delta / .done,
      response.output_item.done                                                              (a call)
    response.completed | response.incomplete | response.failed

every event with a strictly increasing `sequence_number`. The non-streaming path feeds the whole text
once and keeps only the final response object.
"""
from __future__ import annotations

import time
from typing import Any

import orjson

from .reasoning import ReasoningSplitter
from .sse import sse_event
from .responses_protocol import new_item_id
from .tool_parser import StreamingToolParser, ToolCall


def sse(event: dict[str, Any]) -> bytes:
    return sse_event(event, event["type"])


class ResponseBuilder:
    def __init__(self, base: dict[str, Any], parse_tools: bool, splitter: ReasoningSplitter | None = None,
                 summary: bool = False) -> None:
        self.base = base  # the response object's fields, minus status / output / usage
        self.parser = StreamingToolParser() if parse_tools else None
        self.splitter = splitter  # None: the output is all answer
        self.summary = summary  # a reasoning item's summary repeats its text (reasoning.summary was asked for)
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item
        self._seq = 0
        self.final: dict[str, Any] | None = None

    def response(self, status: str, **extra: Any) -> dict[str, Any]:
        return dict(self.base, status=status, output=list(self.output), **extra)

    def start(self) -> list[dict[str, Any]]:
        head = self.response("in_progress", usage=None)
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def feed(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text)
            events += self._reasoning_text(reasoning)
        return events + self._answer(text, logprobs)

    def _answer(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        if self.parser is None:
            return self._content(text, logprobs) if text else []
        events: list[dict[str, Any]] = []
        for kind, value in self.parser.feed(text):
            events += self._content(value, logprobs) if kind == "content" else self._call(value)
            logprobs = None  # a delta's logprobs go with its first content
        return events

    def finish(self, status: str, usage: dict[str, Any], incomplete_reason: str | None = None,
               error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.splitter is not None:
            reasoning, text = self.splitter.finish()
            events += self._reasoning_text(reasoning) + self._answer(text)
        events += self._close_reasoning(status)
        if self.parser is not None:  # a response that did not complete drops a call it had no room to finish
            for kind, value in self.parser.finish(cut=status != "completed"):
                events += self._content(value) if kind == "content" else self._call(value)
        if not any(i["type"] != "reasoning" for i in self.output) and self._message is None and status != "failed":
            events += self._open_message()  # an empty answer is still a message
        events += self._close_message(status)
        details = {"reason": incomplete_reason} if incomplete_reason else None
        self.final = self.response(status, usage=usage, incomplete_details=details, error=error,
                                   completed_at=int(time.time()) if status == "completed" else None)
        events.append(self._event(f"response.{status}", response=self.final))
        return events

    # -- items ----------------------------------------------------------------------------------

    def _reasoning_text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events: list[dict[str, Any]] = []
        if self._reasoning is None:
            self._reasoning = {"type": "reasoning", "id": new_item_id("rs"), "summary": [], "content": [],
                               "status": "in_progress"}
            self.output.append(self._reasoning)
            events.append(self._event("response.output_item.added", output_index=self._index(),
                                      item=_copy(self._reasoning)))
            self._reasoning["content"].append({"type": "reasoning_text", "text": ""})
            events.append(self._event("response.content_part.added", item_id=self._reasoning["id"],
                                      output_index=self._index(), content_index=0,
                                      part=_copy(self._reasoning["content"][0])))
        self._reasoning["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self._reasoning["id"],
                                  output_index=self._index(), content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str = "completed") -> list[dict[str, Any]]:
        if self._reasoning is None:
            return []
        item, index = self._reasoning, self.output.index(self._reasoning)
        self._reasoning = None
        item["status"] = "incomplete" if status == "incomplete" else "completed"
        part = item["content"][0]
        if self.summary:
            item["summary"] = [{"type": "summary_text", "text": part["text"]}]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.reasoning_text.done", **where, text=part["text"]),
                self._event("response.content_part.done", **where, part=_copy(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events = self._close_reasoning() + (self._open_message() if self._message is None else [])
        part = self._message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs or []
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=self._index(), content_index=0, delta=text, logprobs=logprobs or []))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = {"type": "message", "id": new_item_id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []}
        self.output.append(self._message)
        added = self._event("response.output_item.added", output_index=self._index(), item=_copy(self._message))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._message["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=self._message["id"],
                                   output_index=self._index(), content_index=0, part=_copy(part))]

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        if self._message is None:
            return []
        message, index = self._message, self._index()
        self._message = None
        message["status"] = "incomplete" if status == "incomplete" else "completed"
        part = message["content"][0]
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", **where, part=_copy(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(message))]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self._close_reasoning() + self._close_message()
        item = {"type": "function_call", "id": new_item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        index = self._index()
        events.append(self._event("response.output_item.added", output_index=index, item=_copy(item)))
        item["arguments"], item["status"] = call.arguments, "completed"
        where = {"item_id": item["id"], "output_index": index}
        events += [self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                   self._event("response.function_call_arguments.done", **where, name=call.name,
                               arguments=call.arguments),
                   self._event("response.output_item.done", output_index=index, item=_copy(item))]
        return events

    def _index(self) -> int:
        return len(self.output) - 1

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event (the item keeps changing while it streams)."""
    return orjson.loads(orjson.dumps(item))
