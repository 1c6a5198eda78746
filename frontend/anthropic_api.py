"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on chat completions' pipeline.

A request is parsed into chat-template messages, tools and sampling settings (frontend/anthropic_protocol.py),
rendered by the chat template, and run as one engine job, as a chat completion is; the answer's content blocks come
from frontend/anthropic_output.py. A stream is Anthropic's event sequence: `message_start`, `ping`, per block
`content_block_start` / `content_block_delta`... / `content_block_stop`, then `message_delta` (stop reason,
usage) and `message_stop`; a failure after the status line is an `error` event. Errors are Anthropic's
`{"type": "error", "error": {...}}` (frontend/errors.py renders every error under /v1/messages so).
"""
from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .access_log import note_openai_usage
from .anthropic_output import MessageContent, message_usage, stop_reason
from .anthropic_protocol import ENGINE_NAMES, MessagesRequest, parse_messages_request
from .engine_client import collect
from .errors import APIError
from .openai_api import json_response, openai_usage, raise_if_failed, sse_events
from .reasoning import ReasoningSplitter
from .salt_policy import system_boundary_of
from .sessions_api import settle_turn
from .sse import SSEResponse, sse_event
from .state import ServerState
from ..scheduler.req import GenerateResult, StreamDelta


async def create_message(state: ServerState, request: Request, body: Any) -> Any:
    req = parse_messages_request(body, state.structured, state.thinking_key)
    state.check_model(req.model)
    prompt_ids = await asyncio.to_thread(_render, state, req)
    rid = state.new_id("msg").replace("-", "_")
    plan = state.reasoning_plan(prompt_ids, req.reasoning.effective_budget())
    turn = _Turn(state, req, rid, prompt_ids, plan.splitter())
    kwargs = req.reasoning.render_kwargs(state.engine.tokenizer.chat_template)
    system = await system_boundary_of(state, req.sampling, req.messages, req.tools, kwargs, prompt_ids)
    jobs = state.make_jobs(prompt_ids, req.sampling, 1, rid, req.seed, ENGINE_NAMES, system=system,
                           max_new_tokens=req.max_tokens, **plan.sampling())
    # a refusal is a 400 here
    sub = await state.client.submit(jobs, state.client.reserve(1), request, stream=req.stream)
    if req.stream:
        return SSEResponse(sse_events(sub, _MessageStream(turn), request), on_close=sub.close)
    results = await collect(request, sub)
    if results is None:
        return Response(status_code=499)
    r = results[0] if results else None
    raise_if_failed(r)
    turn.content.whole(r, state.engine.tokenizer)
    note_openai_usage(request, turn.chat_usage(r))
    return json_response(turn.message(r))


async def count_tokens(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    """The prompt's length as /v1/messages would render it (system, messages and tools)."""
    req = parse_messages_request(body, state.structured, state.thinking_key, count_only=True)
    state.check_model(req.model)
    return {"input_tokens": len(await asyncio.to_thread(_render, state, req))}


def _render(state: ServerState, req: MessagesRequest) -> list[int]:
    """The chat template's prompt, with its thinking switch where it has one (runs in a worker thread)."""
    template_kwargs = req.reasoning.render_kwargs(state.engine.tokenizer.chat_template)
    return state.render_chat(req.messages, req.tools, **template_kwargs)


class _Turn:
    """One message being answered: its content builder, stop reason and usage."""

    def __init__(self, state: ServerState, req: MessagesRequest, rid: str, prompt_ids: list[int],
                 splitter: ReasoningSplitter | None) -> None:
        self.state, self.req, self.rid, self.prompt_len = state, req, rid, len(prompt_ids)
        self.content = MessageContent(splitter, req.tools is not None, state.thinking_key, req.single_call)

    def envelope(self, content: list[dict[str, Any]], r: GenerateResult | None) -> dict[str, Any]:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": content, "stop_reason": None, "stop_sequence": None,
                "usage": self.usage(r)}

    def usage(self, r: GenerateResult | None) -> dict[str, Any]:
        return message_usage(self.prompt_len, r, self.content.thinking_tokens if r is not None else None)

    def ending(self, r: GenerateResult) -> tuple[str, str | None]:
        """The stop reason and sequence; a session's turn is settled here (a tool call keeps its pin longer)."""
        reason, sequence = stop_reason(r, self.content.num_calls > 0, self.req.sampling["stop"])
        settle_turn(self.state, self.req.sampling.get("session_id"),
                    [b["name"] for b in self.content.blocks if b["type"] == "tool_use"] if reason == "tool_use" else ())
        return reason, sequence

    def message(self, r: GenerateResult) -> dict[str, Any]:
        reason, sequence = self.ending(r)
        return dict(self.envelope(self.content.blocks, r), stop_reason=reason, stop_sequence=sequence)

    def chat_usage(self, r: GenerateResult | None) -> dict[str, Any]:
        """In OpenAI's shape, for the access log."""
        return openai_usage([self.prompt_len], [r] if r is not None else [], 1, self.content.thinking_tokens)


class _MessageStream:
    """The stream handler of openai_api.sse_events, speaking Anthropic's events."""

    def __init__(self, turn: _Turn) -> None:
        self.turn = turn
        self.result: GenerateResult | None = None

    def prologue(self) -> list[bytes]:
        return [_event({"type": "message_start", "message": self.turn.envelope([], None)}),
                _event({"type": "ping"})]

    def on_delta(self, i: int, delta: StreamDelta) -> list[bytes]:
        content = self.turn.content
        events = content.feed(delta.text, len(delta.token_ids))
        if not delta.finished:
            return [_event(e) for e in events]
        r = self.result = delta.result
        events += content.finish(r.cut_short)
        reason, sequence = self.turn.ending(r)
        usage = self.turn.usage(r)
        events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage}, {"type": "message_stop"}]
        return [_event(e) for e in events]

    def usage(self) -> dict[str, Any]:
        return self.turn.chat_usage(self.result)

    def epilogue(self) -> list[bytes]:
        return []

    def on_error(self, exc: APIError) -> list[bytes]:
        return [_event(exc.anthropic_body())]


def _event(payload: dict[str, Any]) -> bytes:
    return sse_event(payload, payload["type"])
