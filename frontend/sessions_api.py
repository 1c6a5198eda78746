"""Sessions over HTTP (scheduler/sessions.py keeps a session's history pinned between its turns).

SGLang's API: POST /open_session {"session_id"?: str, "capacity_of_str_len"?: int} answers the session's id (a
JSON string); POST /close_session {"session_id": str}; /generate names the session in `session_params.id`. The
OpenAI-style APIs (chat, completions, responses) take a `session_id` body field (`extra_body` for the openai SDK)
or an `x-session-id` header. A request naming a session that is not open opens it; sessions close explicitly or
after the engine's idle timeout. SGLang's token-level continuation (`session_params.rid`, `offset`, `replace`,
`drop_previous_output`, and `/open_session`'s `streaming`, where the server appends each input to the session's
context) is refused with a 400: clients send the whole history, which the session keeps cached. A chat
turn that ends with a final answer rather than a tool call shortens its pin's time to live; one that calls tools
names them, so that the session is expected back after those tools' observed latency (`settle_turn`).
A session is its tenant's (frontend/tenants.py): the engine knows it by `engine_session(id, tenant)`, so another
tenant naming the same id opens, continues and closes a session of its own.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Iterable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from .engine_client import engine_call
from .errors import APIError, bad_request
from .state import ServerState
from .tenants import current as current_tenant, engine_session
from ..scheduler.checks import check_session_id
from ..scheduler.fair_share import DEFAULT_TENANT

logger = logging.getLogger(__name__)
HEADER = "x-session-id"
_CONTINUATION_KEYS = ("rid", "offset", "replace", "drop_previous_output")


def _continuation_refused(param: str) -> APIError:
    """SGLang's server-side continuation (its context kept and appended to by the server) is not this server's."""
    return bad_request(f"{param} is not supported: send the whole history (the session keeps it cached)", param,
                       code="unsupported_parameter")


def checked(session_id: Any, param: str) -> str:
    try:
        return check_session_id(session_id)
    except ValueError as exc:
        raise bad_request(str(exc).replace("session_id", param, 1), param) from exc


def apply_header(request: Request, body: Any) -> Any:
    """An `x-session-id` header becomes the body's `session_id` (the one place both meet); a body that names
    another session is a 400."""
    header = request.headers.get(HEADER)
    if header is None or not isinstance(body, dict):
        return body
    named = body.get("session_id")
    if named is not None and named != header:
        raise bad_request(f"the {HEADER} header ({header!r}) and session_id ({named!r}) name different sessions",
                          "session_id")
    return dict(body, session_id=checked(header, HEADER))


def native_session(body: dict[str, Any]) -> str | None:
    """The session of a /generate body: `session_params.id` (SGLang) or `session_id` (the header's)."""
    params, top = body.get("session_params"), body.get("session_id")
    if params is None:
        return None if top is None else checked(top, "session_id")
    if not isinstance(params, dict):
        raise bad_request("session_params must be an object with \"id\"", "session_params")
    for key in _CONTINUATION_KEYS:
        if params.get(key) not in (None, False, 0):
            raise _continuation_refused(f"session_params.{key}")
    sid = checked(params.get("id"), "session_params.id")
    if top is not None and top != sid:
        raise bad_request("session_params.id and the session_id / x-session-id header differ", "session_params.id")
    return sid


async def open_session(state: ServerState, request: Request, body: Any) -> Response:
    if body is not None and not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    body = apply_header(request, body or {})
    capacity = body.get("capacity_of_str_len")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
        raise bad_request("capacity_of_str_len must be a non-negative integer", "capacity_of_str_len")
    if body.get("streaming") not in (None, False):
        # SGLang's streaming session appends each request's input to the session's context on the server; here a
        # request carries its whole history, so a client sending only the new tokens would get answers without it.
        raise _continuation_refused("streaming")
    sid = body.get("session_id")
    tenant = current_tenant().name
    if sid is None and tenant != DEFAULT_TENANT:
        sid = uuid.uuid4().hex  # named here, so that the engine's name can be the tenant's (engine_session)
    named = None if sid is None else engine_session(checked(sid, "session_id"), tenant)
    opened = await engine_call(state.engine, "open_session", (named,))
    # the id as a JSON string, as SGLang; the client's name, not the engine's
    return Response(orjson.dumps(opened if sid is None else sid), media_type="application/json")


async def close_session(state: ServerState, request: Request, body: Any) -> dict[str, Any]:
    body = apply_header(request, body)
    if not isinstance(body, dict) or body.get("session_id") is None:
        raise bad_request("the body must be a JSON object with \"session_id\"", "session_id")
    sid = checked(body["session_id"], "session_id")
    named = engine_session(sid, current_tenant().name)  # another tenant's session of that name is not this one
    return {"session_id": sid, "closed": await engine_call(state.engine, "close_session", (named,))}


def settle_turn(state: ServerState, session_id: str | None, tools: Iterable[str]) -> None:
    """A chat turn of a session ended, calling `tools` (their names) or, with none, giving a final answer: the agent
    comes back after those tools ran (the engine expects it from their return gaps), or may not come back (its pin
    gets the short time to live). Sent without waiting: the reply does not depend on it."""
    if session_id is None:
        return
    session_id = engine_session(session_id, current_tenant().name)
    called = ",".join(sorted({name[:64] for name in tools})) or None  # in parallel: back when the slowest returns

    async def send() -> None:
        try:
            await engine_call(state.engine, "settle_session", (session_id, called))
        except Exception as exc:  # only a pin's time to live is at stake
            logger.debug("settle_session %s: %s", session_id, exc)

    asyncio.ensure_future(send())
