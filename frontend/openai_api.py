"""POST /v1/chat/completions (OpenAI wire format, streamed or not), and what every OpenAI-style handler shares: the
response head, usage, the SSE body and its chunk envelope (frontend/completions_api.py, responses_api.py,
anthropic_api.py)."""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .access_log import note_error, note_first_token, note_openai_usage
from .engine_client import Submission, collect
from .errors import APIError, bad_request
from .logprobs import chat_logprobs
from .protocol import ChatRequest, CommonOptions, parse_chat_request
from .reasoning import ReasoningPlan, ReasoningSplitter, split_output
from .rewrite_prefetch import after_chat_turn
from .salt_policy import system_boundary_of
from .sessions_api import settle_turn
from .sse import DONE, SSEResponse, sse_event
from .state import ServerState
from .tool_parser import StreamingToolParser, parse_tool_calls
from ..scheduler.req import GenerateResult, StreamDelta

logger = logging.getLogger(__name__)


async def chat_completions(state: ServerState, request: Request, body: Any) -> Any:
    req = parse_chat_request(body, state.config.max_n, state.structured)
    common = req.common
    state.check_model(common.model)
    template_kwargs = req.reasoning.render_kwargs(state.engine.tokenizer.chat_template)
    prompt_ids = await asyncio.to_thread(state.render_chat, req.messages, req.tools, **template_kwargs)  # off the loop
    plan = state.reasoning_plan(prompt_ids, req.reasoning.effective_budget())
    names = dict(_CHAT_NAMES, max_new_tokens=common.max_tokens_param)
    max_new = resolve_max_tokens(state, len(prompt_ids), common, names)
    rid = state.new_id("chatcmpl")
    system = await system_boundary_of(state, common.sampling, req.messages, req.tools, template_kwargs, prompt_ids)
    jobs = state.make_jobs(prompt_ids, common.sampling, common.n, rid, common.seed, names, system=system,
                           max_new_tokens=max_new, logprobs=common.logprobs, **plan.sampling())
    # a refusal is a 400 here
    sub = await state.client.submit(jobs, state.client.reserve(len(jobs)), request, stream=common.stream)
    head = response_head(state, rid, common)
    if common.stream:
        handler = _ChatStream(state, req, head, len(jobs), len(prompt_ids), plan, (prompt_ids, template_kwargs))
        return SSEResponse(sse_events(sub, handler, request), on_close=sub.close)
    results = await collect(request, sub)
    if results is None:
        return Response(status_code=499)
    for r in results:
        raise_if_failed(r)
    splitters = [plan.splitter() for _ in results]
    choices = _chat_choices(state, req, results, splitters) if plan.syntax is None \
        else await asyncio.to_thread(_chat_choices, state, req, results, splitters)
    settle_turn(state, common.sampling.get("session_id"), [call["function"]["name"] for c in choices
                                                           if c["finish_reason"] == "tool_calls"
                                                           for call in c["message"].get("tool_calls") or ()])
    after_chat_turn(state, req.messages, req.tools, template_kwargs, prompt_ids, results[0],
                    lambda: choices[0]["message"], common.sampling)
    usage = openai_usage([len(prompt_ids)], results, len(jobs), reasoning_tokens(plan, splitters))
    note_openai_usage(request, usage)
    payload = dict(head, object="chat.completion", choices=choices, usage=usage)
    if common.return_token_ids:
        payload["prompt_token_ids"] = prompt_ids
        for choice, r in zip(choices, results):
            choice["token_ids"] = list(r.output_ids)
    return json_response(payload)


# -- shared ---------------------------------------------------------------------------------


# The engine's parameter names -> this API's (for the engine's refusals).
_CHAT_NAMES = {"prompt": "messages", "max_new_tokens": "max_tokens", "json_schema": "response_format",
               "structural_tag": "tools", "logit_bias": "logit_bias"}


def resolve_max_tokens(state: ServerState, prompt_len: int, common: CommonOptions, names: dict[str, str]) -> int:
    """The request's max_tokens, or its default for this prompt; a refusal names the API's parameters
    (`names`: the engine's names -> this API's, as a job's param_names)."""
    if common.max_tokens is not None:
        return common.max_tokens
    # Chat default: until EOS or the end of the context (and KV pool), capped by the server flag and by the
    # checkpoint's generation_config.json max_new_tokens.
    cap = min(state.config.max_tokens_default, state.engine.tokenizer.default_max_new_tokens or sys.maxsize)
    default = state.client.default_max_tokens(prompt_len, cap, names["prompt"])
    min_tokens = common.sampling["min_new_tokens"]
    if min_tokens > default:  # parsing checked min_tokens only against an explicit max_tokens
        raise bad_request(f"min_tokens ({min_tokens}) must be <= {names['max_new_tokens']}, whose default for this "
                          f"prompt is {default} (the room left in the context, capped by the server)", "min_tokens")
    return default


def openai_usage(prompt_lens: list[int], results: list[GenerateResult], n: int,
                 reasoning: int | None = None) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice); cached is the least any choice got; `reasoning`:
    the reasoning tokens among the completion tokens (None: no reasoning parser, not reported)."""
    prompt_tokens = sum(prompt_lens)
    cached = 0
    for p in range(len(prompt_lens)):
        group = results[p * n:(p + 1) * n]
        cached += min((r.cached_tokens for r in group), default=0)
    completion_tokens = sum(r.completion_tokens for r in results)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def reasoning_tokens(plan: ReasoningPlan, splitters: list[ReasoningSplitter | None]) -> int | None:
    """The choices' reasoning tokens, or None when the server has no reasoning parser."""
    if plan.syntax is None:
        return None
    return sum(s.reasoning_tokens for s in splitters if s is not None)


def response_head(state: ServerState, rid: str, common: Any) -> dict[str, Any]:
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    if common.prompt_cache_key is not None:
        head["prompt_cache_key"] = common.prompt_cache_key
    return head


def json_response(payload: dict[str, Any]) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


# -- chat -----------------------------------------------------------------------------------


def _chat_choice(state: ServerState, req: ChatRequest, index: int, r: GenerateResult,
                 splitter: ReasoningSplitter | None) -> dict[str, Any]:
    text, reasoning = r.text, ""
    if splitter is not None:
        reasoning, text = split_output(splitter, r.text, r.output_ids, state.engine.tokenizer)
    content, calls = parse_tool_calls(text, r.cut_short) if req.tools else (text, [])  # tools: the answer only
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if state.reasoning is not None:
        message.update(_reasoning_fields(reasoning or None))
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    logprobs = chat_logprobs(r.logprobs or [], state.texts) if req.common.logprobs is not None else None
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(r, bool(calls)), "matched_stop": r.matched_stop}


def _chat_choices(state: ServerState, req: ChatRequest, results: list[GenerateResult],
                  splitters: list[ReasoningSplitter | None]) -> list[dict[str, Any]]:
    """The choices with reasoning split off (in a worker thread: counting reasoning tokens decodes ids)."""
    return [_chat_choice(state, req, i, r, s) for i, (r, s) in enumerate(zip(results, splitters))]


def _reasoning_fields(text: str | None) -> dict[str, Any]:
    """Reasoning on a chat message or delta: reasoning_content (DeepSeek's and SGLang's name) and reasoning (vLLM's)."""
    return {"reasoning_content": text, "reasoning": text}


def chat_finish_reason(r: GenerateResult, made_calls: bool) -> str:
    """"tool_calls" when the reply made calls and ended on its own: not aborted (the caller asked it to stop),
    nor cut by max_tokens (a call may be missing: the one it had no room to finish is dropped)."""
    return "tool_calls" if made_calls and not r.cut_short else r.finish_reason


class ChunkStream:
    """What chat and completion streams share: the chunk's envelope, the usage chunk before [DONE], and an error
    event before [DONE] on failure. Subclasses add prologue(), on_delta() and usage() (what epilogue() reports)."""

    def __init__(self, head: dict[str, Any], obj: str, include_usage: bool) -> None:
        self.base = dict(head, object=obj)
        self.include_usage = include_usage
        if include_usage:
            self.base["usage"] = None

    def event(self, index: int, fields: dict[str, Any], finish: str | None, logprobs: Any,
              token_ids: list[int] | None) -> bytes:
        choice = {"index": index, **fields, "logprobs": logprobs, "finish_reason": finish}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return sse_event(dict(self.base, choices=[choice]))

    def epilogue(self) -> list[bytes]:
        if not self.include_usage:
            return [DONE]
        return [sse_event(dict(self.base, choices=[], usage=self.usage())), DONE]

    def on_error(self, exc: APIError) -> list[bytes]:
        return [sse_event(exc.body()), DONE]


class _ChatStream(ChunkStream):
    """Turns engine deltas into chat.completion.chunk events (tool calls parsed on the fly)."""

    def __init__(self, state: ServerState, req: ChatRequest, head: dict[str, Any], num_choices: int,
                 prompt_len: int, plan: ReasoningPlan, rendered: tuple[list[int], dict[str, Any]] = ([], {})) -> None:
        super().__init__(head, "chat.completion.chunk", req.common.include_usage)
        self.state, self.req, self.prompt_len, self.plan = state, req, prompt_len, plan
        self.rendered = rendered  # the prompt ids and the template's keywords (for the history prefetch)
        self.parsers = [StreamingToolParser() if req.tools else None for _ in range(num_choices)]
        self.splitters = [plan.splitter() for _ in range(num_choices)]
        self.results: list[GenerateResult] = []

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
              token_ids: list[int] | None = None) -> bytes:
        return self.event(index, {"delta": delta}, finish, logprobs, token_ids)

    def prologue(self) -> list[bytes]:
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.parsers))]

    def on_delta(self, i: int, delta: StreamDelta) -> list[bytes]:
        parser, splitter = self.parsers[i], self.splitters[i]
        reasoning, text = "", delta.text
        if splitter is not None:  # reasoning split off first: tool calls are parsed in the answer only
            reasoning, text = splitter.feed(delta.text, len(delta.token_ids))
            if delta.finished:
                rest = splitter.finish()
                reasoning, text = reasoning + rest[0], text + rest[1]
        events = [("content", text)] if parser is None else parser.feed(text)
        if delta.finished and parser is not None:
            events += parser.finish(delta.result.cut_short)
        out = [self.chunk(i, _reasoning_fields(reasoning))] if reasoning else []
        logprobs = None
        if self.req.common.logprobs is not None and delta.logprobs:
            logprobs = chat_logprobs(delta.logprobs, self.state.texts)
        content = "".join(v for kind, v in events if kind == "content")
        token_ids = delta.token_ids if self.req.common.return_token_ids else None
        if content or logprobs is not None or token_ids:
            out.append(self.chunk(i, {"content": content}, logprobs=logprobs, token_ids=token_ids))
        calls = [v for kind, v in events if kind == "tool_call"]
        for k, call in enumerate(calls):
            index = parser.num_calls - len(calls) + k
            out.append(self.chunk(i, {"tool_calls": [call.to_openai(index=index)]}))
        if delta.finished:
            r = delta.result
            self.results.append(r)
            finish = chat_finish_reason(r, parser is not None and parser.num_calls > 0)
            if i == 0:  # a session's turn is settled by its first choice
                settle_turn(self.state, self.req.common.sampling.get("session_id"),
                            parser.names if finish == "tool_calls" else ())
                prompt_ids, template_kwargs = self.rendered
                after_chat_turn(self.state, self.req.messages, self.req.tools, template_kwargs, prompt_ids, r,
                                functools.partial(self._message, r), self.req.common.sampling)
            out.append(self.chunk(i, {}, finish=finish))
        return out

    def _message(self, r: GenerateResult) -> dict[str, Any]:
        """The assistant message of a finished choice, as the non-streamed reply has it (built off the loop)."""
        return _chat_choice(self.state, self.req, 0, r, self.plan.splitter())["message"]

    def usage(self) -> dict[str, Any]:
        return openai_usage([self.prompt_len], self.results, len(self.parsers),
                            reasoning_tokens(self.plan, self.splitters))


async def sse_events(sub: Submission, handler: Any, request: Request) -> AsyncIterator[bytes]:
    """The SSE body: handler.prologue(), handler.on_delta() per delta (a list of events, or an awaitable
    of one), handler.epilogue().

    An engine failure mid-stream becomes handler.on_error(exc) (the status line is already sent).
    The first token and the final usage go to the request's access-log line.
    """
    for event in handler.prologue():
        yield event
    try:
        async with aclosing(sub.deltas()) as deltas:
            async for i, delta in deltas:
                if delta.token_ids:
                    note_first_token(request)
                if delta.finished:
                    raise_if_failed(delta.result)
                events = handler.on_delta(i, delta)
                for event in (await events) if inspect.isawaitable(events) else events:
                    yield event
    except APIError as exc:
        note_error(request, exc.body()["error"])
        for event in handler.on_error(exc):
            yield event
        return
    note_openai_usage(request, handler.usage())
    for event in handler.epilogue():
        yield event


def raise_if_failed(r: GenerateResult | None) -> None:
    """A 500 for an engine failure. An abort asked for (/abort_request) is a normal end, finish_reason "abort",
    with what was generated until then (as SGLang answers it, and /generate here)."""
    if r is None or r.failed:
        raise APIError(500, f"generation failed: {(r.error if r else None) or 'no result'}", code="generation_failed")
