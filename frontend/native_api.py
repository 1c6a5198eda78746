"""SGLang-native POST /generate: same request and response shapes, so RuntimeEndpoint works unchanged."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .access_log import note_error, note_first_token, note_usage
from .engine_client import Job, Submission, collect
from .errors import APIError, bad_request
from .logprobs import TokenTexts, native_logprobs, prompt_entries
from .native_protocol import NativeItem, NativeRequest, parse_generate_request
from .sse import DONE, SSEResponse, sse_event
from .state import ServerState
from ..scheduler.req import GenerateResult
from ..scheduler.sampling_params import SamplingParams


async def generate(state: ServerState, request: Request, body: Any) -> Any:
    req = parse_generate_request(body, state.config.max_n, state.structured)
    # One job per result, prompt-major (prompt 0's n results, then prompt 1's), as SGLang orders them.
    job_items = [item for item in req.items for _ in range(item.n)]
    # Text is tokenized off the event loop; token ids need no thread (a hop is ~1 ms of a busy loop's latency).
    tokenizes = any(isinstance(item.prompt, str) for item in req.items)
    jobs = await asyncio.to_thread(_make_jobs, state, req) if tokenizes else _make_jobs(state, req)
    as_list = req.is_batch or len(jobs) > 1  # n > 1 answers a list even for one prompt (SGLang)
    lease = state.client.reserve(len(jobs), None if req.is_batch else "sampling_params.n")
    sub = await state.client.submit(jobs, lease, request, stream=req.stream)  # a refusal is a 400 here
    if req.stream:
        return SSEResponse(_native_events(state, job_items, as_list, sub, request), on_close=sub.close)
    results = await collect(request, sub)
    if results is None:
        return Response(status_code=499)
    for r in results:
        _note_usage(request, r)
    outputs = [_output(state, item, job, r) for item, job, r in zip(job_items, jobs, results)]
    return Response(orjson.dumps(outputs if as_list else outputs[0]), media_type="application/json")


def _make_jobs(state: ServerState, req: NativeRequest) -> list[Job]:
    jobs: list[Job] = []
    for i, item in enumerate(req.items):
        jobs += _make_item_jobs(state, item, i if req.is_batch else None)
    return jobs


def _make_item_jobs(state: ServerState, item: NativeItem, index: int | None) -> list[Job]:
    """item.n jobs for one prompt; with n > 1, choice i samples with seed + i (as the OpenAI path)."""
    where = f"[{index}]" if index is not None else ""
    if isinstance(item.prompt, str):
        param = "text" + where
        prompt_ids = state.encode(item.prompt, param)
    else:
        param = "input_ids" + where
        prompt_ids = item.prompt
    sampling = dict(item.sampling)
    default_max_new = state.engine.tokenizer.default_max_new_tokens  # generation_config.json's, if any
    if default_max_new is not None:
        sampling.setdefault("max_new_tokens", default_max_new)
    if item.return_logprob:
        start = item.logprob_start_len if item.logprob_start_len >= 0 else len(prompt_ids) - 1
        if start >= len(prompt_ids):
            raise bad_request(f"logprob_start_len{where} ({start}) must be less than the prompt length "
                              f"({len(prompt_ids)})", f"logprob_start_len{where}")
        sampling["logprobs"] = item.top_logprobs_num
        sampling["logprob_start_len"] = start
    rid = item.rid if item.rid is not None else state.new_id("gen")
    names = {"prompt": param, "max_new_tokens": f"sampling_params{where}.max_new_tokens",
             **{k: f"sampling_params{where}.{k}" for k in ("regex", "json_schema", "ebnf")}}
    if item.n > 1:
        seed = sampling.pop("seed", None)
        return state.make_jobs(prompt_ids, sampling, item.n, rid, seed, names)
    return [Job(prompt_ids=prompt_ids, params=SamplingParams(**sampling), rid=rid, param_names=names)]


def finish_reason(r: GenerateResult) -> dict[str, Any]:
    if r.finish_reason == "length":
        return {"type": "length", "length": r.completion_tokens}
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    return {"type": "abort", "message": r.error or "aborted"}


def _output(state: ServerState, item: NativeItem, job: Job, r: GenerateResult) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": job.rid, "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens, "finish_reason": finish_reason(r), "e2e_latency": r.e2e_s,
        # The engine's own clock, from the request's arrival there: to its first admission, and to its first token.
        "queue_time": r.queue_s, "engine_ttft": r.ttft_s,
    }
    if item.return_logprob:
        meta.update(_logprob_meta(state, item, job, r.prompt_logprobs, r.output_ids, r.logprobs or []))
    return {"text": r.text, "output_ids": list(r.output_ids), "meta_info": meta}


def _logprob_meta(state: ServerState, item: NativeItem, job: Job, prompt_logprobs: Any,
                  output_ids: list[int], output_logprobs: list[Any]) -> dict[str, Any]:
    texts: TokenTexts | None = state.texts if item.return_text_in_logprobs else None
    top_num = item.top_logprobs_num
    ids, entries = prompt_entries(job.prompt_ids, job.params.logprob_start_len or 0, prompt_logprobs)
    input_values, input_tops = native_logprobs(ids, entries, texts, top_num)
    output_values, output_tops = native_logprobs(output_ids, list(output_logprobs), texts, top_num)
    return {"input_token_logprobs": input_values, "output_token_logprobs": output_values,
            "input_top_logprobs": input_tops, "output_top_logprobs": output_tops}


async def _native_events(state: ServerState, job_items: list[NativeItem], as_list: bool, sub: Submission,
                         request: Request) -> AsyncIterator[bytes]:
    """Each event carries the cumulative text and output ids so far (SGLang's streaming format); with
    several results (a batch, n > 1) each is tagged with its result's position, "index"."""
    jobs = sub.jobs
    texts = [""] * len(jobs)
    ids: list[list[int]] = [[] for _ in jobs]
    logprobs: list[list[Any]] = [[] for _ in jobs]
    try:
        async with aclosing(sub.deltas()) as deltas:
            async for i, delta in deltas:
                texts[i] += delta.text
                ids[i] += delta.token_ids
                logprobs[i] += delta.logprobs
                if delta.token_ids:
                    note_first_token(request)
                if delta.finished:
                    _note_usage(request, delta.result)
                    out = _output(state, job_items[i], jobs[i], delta.result)
                else:
                    out = _partial(state, job_items[i], jobs[i], texts[i], ids[i], logprobs[i])
                if as_list:
                    out["index"] = i
                yield sse_event(out)
    except APIError as exc:
        note_error(request, exc.body()["error"])
        yield sse_event(exc.body())
    yield DONE


def _note_usage(request: Request, r: GenerateResult) -> None:
    note_usage(request, r.prompt_tokens, r.cached_tokens, r.completion_tokens)


def _partial(state: ServerState, item: NativeItem, job: Job, text: str, output_ids: list[int],
             output_logprobs: list[Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": job.rid, "prompt_tokens": len(job.prompt_ids),
                            "completion_tokens": len(output_ids), "cached_tokens": 0, "finish_reason": None}
    if item.return_logprob:
        meta.update(_logprob_meta(state, item, job, None, output_ids, output_logprobs))
        meta["input_token_logprobs"], meta["input_top_logprobs"] = [], []  # known once finished
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}
