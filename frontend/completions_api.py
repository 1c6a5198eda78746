"""POST /v1/completions: OpenAI's legacy text completions (prompts as text or token ids, echo, logprobs, n)."""
from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .access_log import note_openai_usage
from .engine_client import Job, collect
from .logprobs import CompletionLogprobs, prompt_entries
from .openai_api import ChunkStream, json_response, openai_usage, raise_if_failed, response_head, sse_events
from .protocol import CompletionRequest, parse_completion_request
from .sse import SSEResponse
from .state import ServerState
from ..scheduler.req import GenerateResult, StreamDelta

# The engine's parameter names -> this API's (for the engine's refusals).
_COMPLETION_NAMES = {"prompt": "prompt", "max_new_tokens": "max_tokens", "json_schema": "response_format",
                     "logit_bias": "logit_bias"}


async def completions(state: ServerState, request: Request, body: Any) -> Any:
    req = parse_completion_request(body, state.config.max_n)
    common = req.common
    state.check_model(common.model)
    prompts_ids, echo_texts = await asyncio.to_thread(_tokenize_prompts, state, req.prompts, req.echo)
    rid = state.new_id("cmpl")
    echo_logprobs = req.echo and common.logprobs is not None
    jobs: list[Job] = []
    for p, ids in enumerate(prompts_ids):
        sub_rid = rid if len(prompts_ids) == 1 else f"{rid}-{p}"
        jobs += state.make_jobs(ids, common.sampling, common.n, sub_rid, common.seed, _COMPLETION_NAMES,
                                max_new_tokens=common.max_tokens, logprobs=common.logprobs,
                                logprob_start_len=0 if echo_logprobs else None)
    lease = state.client.reserve(len(jobs), "n" if len(prompts_ids) == 1 else None)
    sub = await state.client.submit(jobs, lease, request, stream=common.stream)  # a refusal is a 400 here
    head = response_head(state, rid, common)
    if common.stream:
        handler = _CompletionStream(state, req, head, jobs, echo_texts, [len(i) for i in prompts_ids])
        return SSEResponse(sse_events(sub, handler, request), on_close=sub.close)
    results = await collect(request, sub)
    if results is None:
        return Response(status_code=499)
    for r in results:
        raise_if_failed(r)
    choices = []
    for i, (job, r) in enumerate(zip(jobs, results)):
        echo = echo_texts[i // common.n] if echo_texts is not None else None
        choices.append(_completion_choice(state, req, i, job, r, echo))
    usage = openai_usage([len(i) for i in prompts_ids], results, common.n)
    note_openai_usage(request, usage)
    payload = dict(head, object="text_completion", choices=choices, usage=usage)
    if common.return_token_ids:
        payload["prompt_token_ids"] = prompts_ids if len(prompts_ids) > 1 else prompts_ids[0]
        for choice, r in zip(choices, results):
            choice["token_ids"] = list(r.output_ids)
    return json_response(payload)


def _tokenize_prompts(state: ServerState, prompts: list[str | list[int]], echo: bool
                      ) -> tuple[list[list[int]], list[str] | None]:
    """Each prompt's ids and, with echo, its text (runs in a worker thread: the tokenizer is slow)."""
    prompts_ids = [state.encode(p, "prompt") if isinstance(p, str) else p for p in prompts]
    if not echo:
        return prompts_ids, None
    return prompts_ids, [_echo_text(state, p, ids) for p, ids in zip(prompts, prompts_ids)]


def _echo_text(state: ServerState, prompt: str | list[int], ids: list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(ids)


def _completion_choice(state: ServerState, req: CompletionRequest, index: int, job: Job, r: GenerateResult,
                       echo: str | None) -> dict[str, Any]:
    text = (echo or "") + r.text
    logprobs = None
    if req.common.logprobs is not None:
        ids: list[int] = []
        entries: list[Any] = []
        if echo is not None:
            ids, entries = prompt_entries(job.prompt_ids, 0, r.prompt_logprobs)
        logprobs = CompletionLogprobs(state.texts).build(ids + list(r.output_ids), entries + list(r.logprobs or []))
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason,
            "matched_stop": r.matched_stop}


class _CompletionStream(ChunkStream):
    """Turns engine deltas into text_completion chunks (echo and logprobs included)."""

    def __init__(self, state: ServerState, req: CompletionRequest, head: dict[str, Any], jobs: list[Job],
                 echo_texts: list[str] | None, prompt_lens: list[int]) -> None:
        super().__init__(head, "text_completion", req.common.include_usage)
        self.state, self.req, self.jobs = state, req, jobs
        self.echo_texts, self.prompt_lens = echo_texts, prompt_lens
        self.want_logprobs = req.common.logprobs is not None
        # Prompt logprobs arrive with the final result, so echo + logprobs holds a choice's events.
        self.hold_echo = echo_texts is not None and self.want_logprobs
        self.held: list[list[bytes]] = [[] for _ in jobs]
        self.results: list[GenerateResult | None] = [None] * len(jobs)
        self.builders = []
        for job in jobs:
            # Offsets of generated tokens continue after the echoed prompt tokens.
            start = len(state.texts.joined(list(job.prompt_ids))) if echo_texts is not None else 0
            self.builders.append(CompletionLogprobs(state.texts, text_offset=start))

    def chunk(self, index: int, text: str, finish: str | None = None, logprobs: Any = None,
              token_ids: list[int] | None = None) -> bytes:
        return self.event(index, {"text": text}, finish, logprobs, token_ids)

    def prologue(self) -> list[bytes]:
        if self.echo_texts is None or self.hold_echo:
            return []
        return [self.chunk(i, self.echo_texts[i // self.req.common.n]) for i in range(len(self.jobs))]

    def on_delta(self, i: int, delta: StreamDelta) -> list[bytes]:
        out: list[bytes] = []
        logprobs = (self.builders[i].build(delta.token_ids, delta.logprobs, final=delta.finished)
                    if self.want_logprobs else None)
        token_ids = delta.token_ids if self.req.common.return_token_ids else None
        if delta.text or (logprobs is not None or token_ids) and delta.token_ids:
            out.append(self.chunk(i, delta.text, logprobs=logprobs, token_ids=token_ids))
        if delta.finished:
            self.results[i] = delta.result
            out.append(self.chunk(i, "", finish=delta.result.finish_reason))
        if not self.hold_echo:
            return out
        self.held[i] += out
        if not delta.finished:
            return []
        echo = _echo_chunk(self.state, self.chunk, i, self.jobs[i], self.echo_texts[i // self.req.common.n],
                           delta.result)
        return [echo] + self.held[i]

    def usage(self) -> dict[str, Any]:
        return openai_usage(self.prompt_lens, [r for r in self.results if r is not None], self.req.common.n)


def _echo_chunk(state: ServerState, chunk: Any, index: int, job: Job, echo: str, r: GenerateResult) -> bytes:
    ids, entries = prompt_entries(job.prompt_ids, 0, r.prompt_logprobs)
    return chunk(index, echo, logprobs=CompletionLogprobs(state.texts).build(ids, entries))
