"""The OpenAI Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id}, GET .../input_items.

A request becomes one engine job: its prompt is the chat template over the instructions, the stored
conversation of `previous_response_id` (if any) and this turn's input. When the previous turn was rendered
with the same instructions and tools, the prompt is instead exactly the previous turn's prompt and output
token ids followed by the template's text for the new items (`continuation_ids`), so the radix cache serves
the whole history however the model's own tokens would re-tokenize. Otherwise (instructions or tools
changed; they are not carried over, as in OpenAI's API) the conversation is rendered afresh.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .access_log import note_openai_usage
from .engine_client import collect
from .errors import APIError, bad_request
from .fields import FieldReader
from .logprobs import chat_logprobs
from .reasoning import ReasoningPlan, reasoning_token_count
from .openai_api import (
    json_response,
    openai_usage,
    raise_if_failed,
    resolve_max_tokens,
    sse_events,
)
from .response_store import StoredResponse
from .responses_output import ResponseBuilder, sse
from .responses_protocol import (
    ResponsesRequest,
    items_to_messages,
    parse_responses_request,
    rename_param,
)
from .salt_policy import system_boundary_of
from .sse import SSEResponse
from .sessions_api import settle_turn
from .state import ServerState
from .tenants import current as current_tenant
from ..scheduler.req import GenerateResult, StreamDelta

# incomplete_details.reason of a response whose generation ended for this finish_reason (an abort asked for
# with /abort_request keeps the engine's name, as chat and completions' finish_reason do).
_INCOMPLETE_REASONS = {"length": "max_output_tokens", "abort": "abort"}
# The engine's parameter names -> this API's (for the engine's refusals).
_NAMES = {"prompt": "input", "max_new_tokens": "max_output_tokens", "json_schema": "text.format",
          "structural_tag": "tools", "logit_bias": "logit_bias"}


async def create_response(state: ServerState, request: Request, body: Any) -> Any:
    req = parse_responses_request(body, state.structured)
    common = req.chat.common
    state.check_model(common.model)
    prev = await _previous(state, req.previous_response_id)
    if not req.input_items and prev is None:
        raise bad_request("input must not be empty", "input")
    try:
        prompt_ids = await asyncio.to_thread(_prompt_ids, state, req, prev)
    except APIError as exc:  # the chat template's refusals name the chat's `messages`
        exc.param = rename_param(exc.param)
        raise
    plan = state.reasoning_plan(prompt_ids, req.chat.reasoning.effective_budget())
    max_new = resolve_max_tokens(state, len(prompt_ids), common, _NAMES)
    rid = state.new_id("resp").replace("-", "_")
    if (session := _chain_session(req, prev, rid)) is not None:
        common.sampling["session_id"] = session
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    kwargs = req.chat.reasoning.render_kwargs(state.engine.tokenizer.chat_template)
    system = await system_boundary_of(state, common.sampling, instructions, req.chat.tools, kwargs, prompt_ids)
    jobs = state.make_jobs(prompt_ids, common.sampling, 1, rid, common.seed, _NAMES, system=system,
                           max_new_tokens=max_new, logprobs=common.logprobs, **plan.sampling())
    # a refusal is a 400 here
    sub = await state.client.submit(jobs, state.client.reserve(1), request, stream=common.stream)
    turn = _Turn(state, req, rid, prompt_ids, prev, plan)
    if common.stream:
        return SSEResponse(sse_events(sub, _Stream(turn), request), on_close=sub.close)
    results = await collect(request, sub)
    if results is None:
        return Response(status_code=499)
    raise_if_failed(results[0] if results else None)
    turn.builder.feed(results[0].text, turn.logprobs(results[0].logprobs))
    await asyncio.to_thread(turn.finish, results[0])
    turn.settle()
    note_openai_usage(request, turn.chat_usage)
    return json_response(turn.builder.final)


async def get_response(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    return (await _stored(state, request.path_params["response_id"])).response


async def delete_response(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    response_id = request.path_params["response_id"]
    if not await asyncio.to_thread(state.responses.delete, response_id, current_tenant().name):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


async def input_items(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    """This response's input items, newest first unless order=asc; `after` an item id, `limit` 1-100."""
    stored = await _stored(state, request.path_params["response_id"])
    query = FieldReader(dict(request.query_params), prefix="")
    order = query.choice("order", ("asc", "desc"), "desc")
    limit_raw = query.str("limit", "20")
    if not limit_raw.isdigit() or not 1 <= int(limit_raw) <= 100:
        raise bad_request(f"limit must be an integer from 1 to 100, got {limit_raw!r}", "limit")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = query.str("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after names no input item of this response: {after!r}", "after")
        items = items[ids.index(after) + 1:]
    page = items[:int(limit_raw)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


# -- one turn ----------------------------------------------------------------------------------


class _Turn:
    """What one response needs beyond the engine's result: its output builder, and what to store."""

    def __init__(self, state: ServerState, req: ResponsesRequest, rid: str, prompt_ids: list[int],
                 prev: StoredResponse | None, plan: ReasoningPlan) -> None:
        self.state, self.req, self.rid, self.prompt_ids, self.prev = state, req, rid, prompt_ids, prev
        self.plan = plan
        self.tenant = current_tenant().name  # the stored response is its (another tenant's lookups get 404)
        self.created_at = int(time.time())
        base = {"id": rid, "object": "response", "created_at": self.created_at, "model": state.model_name,
                "error": None, "incomplete_details": None, "previous_response_id": req.previous_response_id,
                "store": req.store, "background": False, **req.echo}
        self.builder = ResponseBuilder(base, parse_tools=bool(req.chat.tools), splitter=plan.splitter(),
                                       summary=req.echo["reasoning"]["summary"] is not None)
        self.chat_usage: dict[str, Any] = openai_usage([len(prompt_ids)], [], 1)

    def logprobs(self, entries: Any) -> list[dict[str, Any]] | None:
        if self.req.chat.common.logprobs is None or not entries:
            return None
        return chat_logprobs(entries, self.state.texts)["content"]

    def finish(self, r: GenerateResult) -> list[dict[str, Any]]:
        """The closing events; the response is stored (when asked) before they are sent."""
        reasoning = self._reasoning_tokens(r)
        self.chat_usage = openai_usage([len(self.prompt_ids)], [r], 1, reasoning)
        usage = {"input_tokens": len(self.prompt_ids),
                 "input_tokens_details": {"cached_tokens": r.cached_tokens},
                 "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning or 0},
                 "total_tokens": len(self.prompt_ids) + r.completion_tokens}
        reason = _INCOMPLETE_REASONS.get(r.finish_reason)
        events = self.builder.finish("incomplete" if reason else "completed", usage, reason)
        if self.req.store:
            self.state.responses.put(self._stored(r))
        return events

    def _reasoning_tokens(self, r: GenerateResult) -> int | None:
        """Output tokens up to the end of the reasoning (None without a parser), the same streamed or not."""
        splitter = self.builder.splitter
        if self.plan.syntax is None:
            return None
        if splitter is None or not splitter.entered:
            return 0
        return reasoning_token_count(splitter.syntax, splitter.starts_in_reasoning, r.output_ids,
                                     self.state.engine.tokenizer)

    def settle(self) -> None:
        """A session's turn that ended without a function call keeps its pin only briefly (sessions_api)."""
        output = self.builder.final.get("output") or []
        settle_turn(self.state, self.req.chat.common.sampling.get("session_id"),
                    [item["name"] for item in output if item.get("type") == "function_call"])

    def fail(self, exc: APIError) -> list[dict[str, Any]]:
        error = {"code": str(exc.body()["error"]["code"]), "message": exc.message}
        return self.builder.finish("failed", None, error=error)

    def _stored(self, r: GenerateResult) -> StoredResponse:
        history = self.prev.conversation if self.prev is not None else []
        conversation = history + self.req.conversation + items_to_messages(self.builder.final["output"])
        return StoredResponse(id=self.rid, created_at=time.time(), response=self.builder.final,
                              input_items=self.req.input_items, conversation=conversation,
                              context_key=_context_key(self.req), prompt_ids=self.prompt_ids,
                              output_ids=list(r.output_ids), session_id=self.req.chat.common.sampling.get("session_id"),
                              tenant=self.tenant)


class _Stream:
    """The SSE events of one turn, for openai_api.sse_events (the response is stored before the last)."""

    def __init__(self, turn: _Turn) -> None:
        self.turn = turn

    def prologue(self) -> list[bytes]:
        return [sse(e) for e in self.turn.builder.start()]

    async def on_delta(self, index: int, delta: StreamDelta) -> list[bytes]:
        events = self.turn.builder.feed(delta.text, self.turn.logprobs(delta.logprobs))
        if delta.finished:
            events += await asyncio.to_thread(self.turn.finish, delta.result)
            self.turn.settle()
        return [sse(e) for e in events]

    def on_error(self, exc: APIError) -> list[bytes]:
        return [sse(e) for e in self.turn.fail(exc)]

    def usage(self) -> dict[str, Any]:
        return self.turn.chat_usage

    def epilogue(self) -> list[bytes]:
        return []  # no [DONE]: the Responses stream ends with its terminal event


# -- prompts -----------------------------------------------------------------------------------


def _context_key(req: ResponsesRequest) -> str:
    """What a prompt's rendering depends on besides the conversation: the instructions and the tools."""
    raw = orjson.dumps([req.instructions, req.chat.tools], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


def _prompt_ids(state: ServerState, req: ResponsesRequest, prev: StoredResponse | None) -> list[int]:
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    history = prev.conversation if prev is not None else []
    tools = req.chat.tools
    kwargs = req.chat.reasoning.render_kwargs(state.engine.tokenizer.chat_template)  # the thinking switch
    ids = None
    if prev is not None and prev.context_key == _context_key(req):
        ids = continuation_ids(state.engine.tokenizer, system + history, req.conversation, tools,
                               prev.prompt_ids + prev.output_ids, prev.output_ids, kwargs)
    conversation = history + req.conversation
    if ids is None:
        ids = state.render_chat(system + conversation, tools, **kwargs)
    if req.truncation == "auto":  # drop the oldest messages until the prompt leaves room to answer
        while len(ids) >= state.client.context_length and len(conversation) > 1:
            conversation = _drop_oldest_turn(conversation)
            ids = state.render_chat(system + conversation, tools, **kwargs)
    return ids


def continuation_ids(tokenizer: Any, history: list[dict[str, Any]], new: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, past_ids: list[int], output_ids: list[int],
                     template_kwargs: dict[str, Any] | None = None) -> list[int] | None:
    """past_ids (the previous prompt + output, exactly) + the tokens of what the template writes after the
    previous assistant turn; None when the template does not extend the history by appending (then the
    caller renders the whole conversation)."""
    kwargs = template_kwargs or {}
    try:
        before = tokenizer.render_chat(history, tools, add_generation_prompt=False, **kwargs)
        full = tokenizer.render_chat(history + new, tools, add_generation_prompt=True, **kwargs)
    except Exception:
        return None
    ended = bool(output_ids) and output_ids[-1] in tokenizer.eos_token_ids
    # Where the assistant turn ends in the template's text: at the model's own EOS token when the template
    # writes that one, else at the tokenizer's (a model may end with another of its EOS ids, <|endoftext|>).
    end_text = tokenizer.eos_token
    if ended and tokenizer.decode(output_ids[-1:], skip_special_tokens=False) in before:
        end_text = tokenizer.decode(output_ids[-1:], skip_special_tokens=False)
    if not full.startswith(before) or not end_text or end_text not in before:
        return None
    after_end = before[before.rindex(end_text) + len(end_text):]  # e.g. "\n" after <|im_end|>
    closing = "" if ended else end_text  # a turn cut short (max tokens) is closed as the template closes it
    return past_ids + tokenizer.encode(closing + after_end + full[len(before):], add_special_tokens=False)


def _drop_oldest_turn(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """truncation "auto": the conversation without its oldest message and the tool results that answered it
    (the last message always stays)."""
    rest = history[1:]
    while len(rest) > 1 and rest[0]["role"] == "tool":
        rest = rest[1:]
    return rest


# -- the store ---------------------------------------------------------------------------------


def _chain_session(req: ResponsesRequest, prev: StoredResponse | None, rid: str) -> str | None:
    """The session of a turn: the one the client names; else a `previous_response_id` chain is one (its first
    stored turn's id names it), so an agent's history stays pinned while its function call runs."""
    if (named := req.chat.common.sampling.get("session_id")) is not None:
        return named
    if prev is not None:
        return prev.session_id or prev.id
    return rid if req.store else None


async def _previous(state: ServerState, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = await asyncio.to_thread(state.responses.get, response_id, current_tenant().name)
    if stored is None:
        raise APIError(404, f"no stored response with id {response_id!r} (it was never stored, was deleted, or "
                       "expired)", param="previous_response_id", code="response_not_found")
    return stored


async def _stored(state: ServerState, response_id: str) -> StoredResponse:
    stored = await asyncio.to_thread(state.responses.get, response_id, current_tenant().name)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r}", param="response_id",
                    code="response_not_found")
