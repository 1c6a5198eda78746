"""The Starlette app: routes, API-key check, body limit, error rendering; native info endpoints."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from . import (anthropic_api, completions_api, native_api, openai_api, responses_api, sessions_api, tenants,
               tokenize_api)
from .access_log import AccessLog, note_probe, note_tenant
from .config import ServerConfig
from .engine_client import EngineClient, Job, engine_call
from .errors import APIError, ErrorGuard, bad_request, exception_handlers, shutting_down
from .logprobs import TokenTexts, token_bytes_fn
from .metrics import ServerMetrics
from .reasoning import supports_thinking_toggle
from .response_store import ResponseStore
from .state import ServerState
from .tenants import Tenants
from ..scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0
Handler = Callable[[ServerState, Request, Any], Awaitable[Any]]


def build_state(engine: Any, config: ServerConfig, tenants: Tenants | None = None) -> ServerState:
    """`engine` is a started frontend.engine_proc.EngineProcess; `tenants` the keys (None: read from `config`)."""
    metrics = ServerMetrics()
    tokenizer = engine.tokenizer
    _use_chat_template(tokenizer, config.chat_template)
    texts = TokenTexts(lambda t: tokenizer.decode([t], skip_special_tokens=False), token_bytes_fn(tokenizer),
                       lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    state = ServerState(engine=engine, config=config, client=EngineClient(engine, config, metrics),
                       metrics=metrics, model_name=config.model_name(), texts=texts,
                       created=int(time.time()),
                       responses=ResponseStore(config.response_store, config.response_store_max_items,
                                               config.response_store_ttl_s),
                       tenants=tenants if tenants is not None else Tenants.from_config(config.api_key, config.api_keys))
    _log_reasoning(state)
    return state


def _log_reasoning(state: ServerState) -> None:
    """Which reasoning parser --reasoning-parser gave (auto: from the template), and whether thinking can be off."""
    if state.config.reasoning_parser is None:
        return
    template = state.engine.tokenizer.chat_template
    if state.reasoning is None:
        logger.warning("--reasoning-parser auto: the chat template shows no <think> tags; outputs are all answer")
        return
    switch = "enable_thinking" if supports_thinking_toggle(template) else "none in the template"
    logger.info("reasoning parser: %s (--reasoning-parser %s); thinking switch: %s", state.reasoning.kind,
                state.config.reasoning_parser, switch)


def _use_chat_template(tokenizer: Any, path: str | None) -> None:
    """--chat-template FILE replaces the checkpoint's template; without either, say at start-up that chat fails."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            tokenizer.set_chat_template(f.read())
        logger.info("chat template: %s", path)
    elif not tokenizer.has_chat_template:
        logger.warning("the checkpoint %s has no chat template: /v1/chat/completions will answer 400 (plain "
                       "/v1/completions and /generate work); pass --chat-template FILE to supply one", tokenizer.path)


def build_app(state: ServerState) -> Starlette:
    def route(path: str, handler: Handler, methods: list[str], auth: bool = True, body: bool = False,
              health: bool = False, admin: bool = False) -> Route:
        return Route(path, _endpoint(state, handler, auth=auth, body=body, health=health, admin=admin),
                     methods=methods)

    routes = [
        route("/v1/chat/completions", openai_api.chat_completions, ["POST"], body=True),
        route("/v1/completions", completions_api.completions, ["POST"], body=True),
        route("/v1/responses", responses_api.create_response, ["POST"], body=True),
        route("/v1/responses/{response_id}", responses_api.get_response, ["GET"]),
        route("/v1/responses/{response_id}", responses_api.delete_response, ["DELETE"]),
        route("/v1/responses/{response_id}/input_items", responses_api.input_items, ["GET"]),
        route("/v1/messages", anthropic_api.create_message, ["POST"], body=True),
        route("/v1/messages/count_tokens", anthropic_api.count_tokens, ["POST"], body=True),
        route("/v1/models", _list_models, ["GET"]),
        route("/v1/models/{model:path}", _get_model, ["GET"]),
        route("/generate", native_api.generate, ["POST"], body=True),
        route("/get_model_info", _model_info, ["GET"]),
        route("/model_info", _model_info, ["GET"]),  # SGLang's newer names, probed first by sglang-router
        route("/get_server_info", _server_info, ["GET"], admin=True),
        route("/server_info", _server_info, ["GET"], admin=True),
        route("/get_load", _get_load, ["GET"]),
        route("/flush_cache", _flush_cache, ["POST", "GET"], admin=True),
        route("/abort_request", _abort_request, ["POST"], body=True),
        route("/open_session", sessions_api.open_session, ["POST"], body=True),
        route("/close_session", sessions_api.close_session, ["POST"], body=True),
        route("/metrics", _metrics, ["GET"], admin=True),
        route("/health", _health, ["GET"], auth=False, health=True),
        route("/health_generate", _health_generate, ["GET"], auth=False, health=True),
        route("/tokenize", tokenize_api.tokenize, ["POST"], body=True),
        route("/detokenize", tokenize_api.detokenize, ["POST"], body=True),
        route("/concate_and_append_request", _not_supported, ["POST", "GET"]),
    ]
    # Outermost first: the access log sees what ErrorGuard answers for a request that failed.
    middleware = [] if state.config.disable_log_requests else [Middleware(AccessLog)]
    middleware.append(Middleware(ErrorGuard))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers=exception_handlers(state.metrics.observe_response))
    app.state.radixserve = state
    return app


def _endpoint(state: ServerState, handler: Handler, auth: bool, body: bool, health: bool, admin: bool
              ) -> Callable[[Request], Awaitable[Any]]:
    async def endpoint(request: Request) -> Any:
        if health:
            note_probe(request)
        try:
            if auth:
                _authenticate(state, request, admin)
            if state.client.draining and not health:
                raise shutting_down()
            payload = await read_json(request, state.config.max_body_bytes) if body else None
            payload = sessions_api.apply_header(request, payload)
            response = await handler(state, request, payload)
        except APIError as exc:
            response = exc.response(request.url.path)
        except ClientDisconnect:  # the client left while sending its body: nobody to answer
            logger.info("client disconnected while sending %s", request.url.path)
            response = Response(status_code=499)
        except Exception as exc:  # a bug in one request must not take the server down
            logger.exception("unhandled error in %s", request.url.path)
            response = APIError(500, f"internal error: {exc}").response(request.url.path)
        if isinstance(response, (dict, list)):
            response = Response(orjson.dumps(response), media_type="application/json")
        state.metrics.observe_response(getattr(response, "status_code", 200))
        return response

    return endpoint


def _authenticate(state: ServerState, request: Request, admin: bool) -> None:
    """The one key check, on every path but the health checks: the key's tenant becomes the request's
    (frontend/tenants.py: `Authorization: Bearer` or `x-api-key`; 401 without a known key), and an admin
    endpoint needs an admin key (403)."""
    tenant = state.tenants.authenticate(request.headers)
    tenants.enter(tenant)
    if state.tenants.keyed:
        note_tenant(request, tenant.name)
    if admin:
        tenants.require_admin(tenant, request.url.path)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past `limit` bytes (checked before and while reading)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(_json_error(raw, exc)) from exc


def _json_error(raw: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"the request body is not valid UTF-8 (byte {bad.start}); send JSON encoded as UTF-8"
    return f"the request body is not valid JSON: {exc}"


# -- small endpoints --------------------------------------------------------------------------


async def _list_models(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state)]}


async def _get_model(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    state.check_model(request.path_params["model"])
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "radixserve",
            "root": state.engine.info.model_path, "max_model_len": state.client.context_length}


async def _model_info(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    path = state.engine.info.model_path
    return {"model_path": path, "tokenizer_path": path, "is_generation": True,
            "served_model_name": state.model_name, "context_length": state.client.context_length}


async def _server_info(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    """The settings, plus the fields SGLang's server info has and sglang-router 0.3.2 registers a worker by:
    `served_model_name` (its model id, what /v1/models lists through it) and `model_path` (it loads its
    tokenizer from there; a local directory, never fetched from the Hub)."""
    info = state.config.public_dict()
    path = state.engine.info.model_path
    info.update({
        "served_model_name": state.model_name,
        "model_path": path,
        "tokenizer_path": path,
        "engine_config": state.engine.info.engine_config,
        "engine_pid": state.engine.info.pid,
        "attention": state.engine.info.attention,
        "engine_messages": state.engine.num_messages,
        **state.gc.stats(),  # this process's startup heap and full collections (scheduler/gc_freeze.py)
        "context_length": state.client.context_length,
        "max_queued_requests": state.config.max_queued_requests,
        "num_in_flight": state.client.num_in_flight,
        "stats": await engine_call(state.engine, "stats"),
    })
    return info


async def _get_load(state: ServerState, request: Request, body: Any) -> list[dict[str, Any]]:
    """What a router balances on, in SGLang's shape: one entry per data-parallel rank (one here).
    sglang-router 0.3.2 sums `num_tokens` (KV slots held by live requests; cached prefixes not
    counted) as the worker's load and reads `num_waiting_reqs`."""
    stats = await engine_call(state.engine, "stats")
    running, waiting = stats["num_running"], stats["num_waiting"]
    total = stats["total_slots"]
    used = total - stats["free_slots"] - stats["evictable_slots"]
    return [{"dp_rank": 0, "num_reqs": running + waiting, "num_running_reqs": running, "num_waiting_reqs": waiting,
             "num_tokens": used, "num_in_flight": state.client.num_in_flight,
             "token_usage": used / total if total else 0.0, "cache_hit_rate": stats["cache_hit_rate"]}]


async def _flush_cache(state: ServerState, request: Request, body: Any) -> Response:
    busy = APIError(400, "cache not flushed: requests are queued or running; retry when idle", code="busy")
    if state.client.num_in_flight or not await engine_call(state.engine, "flush_cache"):
        raise busy
    return PlainTextResponse("Cache flushed.\n")


async def _abort_request(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    """SGLang's POST /abort_request {"rid": ...}: aborts that request's generations (200 even
    if none is open, as SGLang answers); "abort_all": true aborts everything open."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object with \"rid\"")
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise bad_request("abort_all must be a boolean", "abort_all")
    tenant = tenants.current()
    owner = None if tenant.admin else tenant.name  # a tenant aborts its own requests only; an admin key anyone's
    if abort_all:
        return {"aborted": state.client.abort_matching(None, owner)}
    if not isinstance(rid, str) or not rid:
        raise bad_request("rid must be a non-empty string", "rid")
    return {"aborted": state.client.abort_matching(rid, owner)}


async def _not_supported(state: ServerState, request: Request, body: Any) -> Response:
    """Endpoints other servers have that this one deliberately does not: a clear 400, not a bare 404."""
    raise APIError(400, f"{request.url.path} is not supported by this server (it has no endpoint that "
                   "concatenates requests' KV; a program's forks share their prefix through the radix cache)",
                   code="unsupported_endpoint")


async def _metrics(state: ServerState, request: Request, body: Any) -> Response:
    text = state.metrics.render(await engine_call(state.engine, "stats"), state.client.num_in_flight,
                                dict(state.client.limiter.refused))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _check_health(state: ServerState) -> None:
    """503 while draining, when the engine process is gone, or when it made no step progress
    for --watchdog-timeout seconds while work is open."""
    if state.client.draining:
        raise APIError(503, "the server is shutting down", code="server_shutting_down")
    if state.engine.dead:
        raise APIError(503, "the engine process died", code="engine_dead")
    timeout = state.config.watchdog_timeout_s
    if state.engine.stalled(timeout):
        raise APIError(503, f"the engine made no progress for {timeout:g}s with requests open", code="engine_stalled")


async def _health(state: ServerState, request: Request, body: Any) -> Response:
    _check_health(state)
    return Response(status_code=200)


async def _health_generate(state: ServerState, request: Request, body: Any) -> Response:
    """A real one-token generation through the engine: 503 if it fails or times out."""
    _check_health(state)
    job = Job(prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0),
              rid=state.new_id("health"))
    timeout = min(HEALTH_GENERATE_TIMEOUT_S, state.config.watchdog_timeout_s)
    try:
        lease = state.client.reserve(1)
        results = await asyncio.wait_for(state.client.generate([job], lease), timeout)
    except (APIError, asyncio.TimeoutError) as exc:
        logger.warning("health_generate failed: %r", exc)
        raise APIError(503, f"the engine did not generate: {_reason(exc)}", code="unhealthy") from exc
    if not results or results[0].finish_reason == "abort":
        reason = results[0].error if results else "no result"
        logger.warning("health_generate failed: %s", reason)
        raise APIError(503, f"the engine did not generate: {reason}", code="unhealthy")
    return Response(status_code=200)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        return exc.message
    return f"no token within {HEALTH_GENERATE_TIMEOUT_S:g}s" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
