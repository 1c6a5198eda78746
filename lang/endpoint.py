"""Endpoint: the DSL over HTTP, speaking SGLang's native `/generate` (ARCHITECTURE §9).

The chat template and the tokenizer (for `select`'s token positions) are loaded on the client
from the server's `/get_model_info` tokenizer_path, or from `tokenizer_path=` when the server's
path is not readable here.

HTTP is the standard library's (http.client), so the DSL runs on the base install, over a pool of
keep-alive connections (programs send from many threads: forks, batches).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import urllib.parse
from contextlib import contextmanager
from typing import Any, Iterator

from .backend import Backend, BackendError, GenOutput, LocalTokenizer, TextCallback
from .roles import ChatTemplate

logger = logging.getLogger(__name__)

# Fields that sit beside sampling_params in a /generate request rather than inside it.
_LOGPROB_KEYS = ("logprob_start_len",)


class Endpoint(Backend):
    name = "Endpoint"

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
                 tokenizer_path: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = _Connections(self.url, headers, timeout_s)
        self.model_info = self._get("/get_model_info")
        path = tokenizer_path or self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        try:
            self._tokenizer: LocalTokenizer | None = _load_tokenizer(path)
        except Exception as exc:  # no local copy: plain-text programs still work
            logger.warning("cannot load the tokenizer %r on the client (%s); roles and select need it; "
                           "pass tokenizer_path=", path, exc)
            self._tokenizer = None

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._tokenizer.template if self._tokenizer is not None else None

    def prompt_text(self, text: str) -> str:
        return self._tokenizer.prompt_text(text) if self._tokenizer is not None else text

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise BackendError(f"{self.url}: no client-side tokenizer (pass Endpoint(..., tokenizer_path=))")
        return self._tokenizer.encode(text)

    def generate(self, prompt: str, params: dict[str, Any], on_text: TextCallback | None = None) -> GenOutput:
        payload = _payload(self.prompt_text(prompt), params)
        if on_text is None:
            return _parse(self._post(payload, prompt), prompt, self.url)
        payload["stream"] = True
        return self._stream(payload, prompt, on_text)

    def generate_batch(self, prompts: list[str], params: list[dict[str, Any]]) -> list[GenOutput]:
        """One /generate call with a list of prompts (and per-prompt sampling_params and
        logprob_start_len), as SGLang's batch format allows."""
        singles = [_payload(self.prompt_text(p), sp) for p, sp in zip(prompts, params)]
        payload: dict[str, Any] = {"text": [s["text"] for s in singles],
                                   "sampling_params": [s["sampling_params"] for s in singles]}
        session = next((s["session_params"] for s in singles if "session_params" in s), None)
        if session is not None:  # one program's prompts: one session
            payload["session_params"] = session
        if any(s.get("return_logprob") for s in singles):
            payload["return_logprob"] = True
            payload["logprob_start_len"] = [s.get("logprob_start_len", -1) for s in singles]
            payload["top_logprobs_num"] = 0
        body = self._post(payload, f"batch of {len(prompts)} prompts")
        if not isinstance(body, list) or len(body) != len(prompts):
            raise BackendError(f"{self.url}/generate answered a batch of {len(prompts)} with {str(body)[:200]}")
        return [_parse(item, p, self.url) for item, p in zip(body, prompts)]

    def shutdown(self) -> None:
        self._http.close()

    def open_session(self) -> str | None:
        """SGLang's /open_session (radixserve and SGLang both have it); None where the server has none."""
        try:
            sid = self._call("POST", "/open_session", {}, f"POST {self.url}/open_session")
        except BackendError:
            return None
        return sid if isinstance(sid, str) else None

    def close_session(self, session_id: str) -> None:
        try:
            self._call("POST", "/close_session", {"session_id": session_id}, f"POST {self.url}/close_session")
        except (BackendError, ValueError):  # the run is over either way; the server's idle timeout closes it
            pass

    # --- HTTP -------------------------------------------------------------------------------

    def _get(self, path: str) -> dict[str, Any]:
        return self._call("GET", path, None, f"GET {self.url}{path}")

    def _post(self, payload: dict[str, Any], what: str) -> Any:
        return self._call("POST", "/generate", payload, f"POST {self.url}/generate ({_describe(what)})")

    def _call(self, method: str, path: str, payload: dict[str, Any] | None, label: str) -> Any:
        try:
            with self._http.request(method, path, payload) as resp:
                body = resp.read()
        except _TRANSPORT_ERRORS as exc:
            raise BackendError(f"{label} failed: {type(exc).__name__}: {exc}") from exc
        _raise_for_status(resp.status, body, label)
        return json.loads(body)

    def _stream(self, payload: dict[str, Any], prompt: str, on_text: TextCallback) -> GenOutput:
        label = f"POST {self.url}/generate ({_describe(prompt)}, stream)"
        last: dict[str, Any] | None = None
        sent_len = 0
        try:
            with self._http.request("POST", "/generate", payload) as resp:
                if resp.status != 200:
                    _raise_for_status(resp.status, resp.read(), label)
                for raw in resp:  # http.client undoes the chunked encoding; one SSE line at a time
                    line = raw.decode("utf-8").rstrip("\r\n")
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise BackendError(f"{label} failed: {_error_message(event)}")
                    text = event.get("text", "")  # cumulative
                    if len(text) > sent_len:
                        on_text(text[sent_len:])
                        sent_len = len(text)
                    last = event
        except _TRANSPORT_ERRORS as exc:
            raise BackendError(f"{label} failed: {type(exc).__name__}: {exc}") from exc
        if last is None:
            raise BackendError(f"{label} ended without a result")
        return _parse(last, prompt, self.url)


def _payload(prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    sampling = {k: v for k, v in params.items() if k not in _LOGPROB_KEYS and k != "session_id"}
    if isinstance(sampling.get("json_schema"), dict):
        # SGLang's /generate takes the schema as a JSON string; its key order is the output's.
        sampling["json_schema"] = json.dumps(sampling["json_schema"], ensure_ascii=False)
    payload: dict[str, Any] = {"text": prompt, "sampling_params": sampling}
    if params.get("session_id") is not None:
        payload["session_params"] = {"id": params["session_id"]}  # SGLang's place for it
    start = params.get("logprob_start_len")
    if start is not None:
        payload.update(return_logprob=True, logprob_start_len=start, top_logprobs_num=0)
    return payload


def _parse(body: dict[str, Any], prompt: str, url: str) -> GenOutput:
    meta = body.get("meta_info") or {}
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort" or "error" in body:
        cause = reason.get("message") if isinstance(reason, dict) else None
        raise BackendError(f"request {meta.get('id', '?')} to {url} ({_describe(prompt)}) failed: "
                           f"{cause or _error_message(body) or 'aborted'}")
    prompt_logprobs = None
    if meta.get("input_token_logprobs") is not None:
        # Entries are [logprob, token_id, text]; position 0 carries None (nothing precedes it).
        prompt_logprobs = [e[0] for e in meta["input_token_logprobs"] if e[0] is not None]
    return GenOutput(text=body.get("text", ""), output_ids=list(body.get("output_ids") or []),
                     prompt_tokens=int(meta.get("prompt_tokens", 0)), cached_tokens=int(meta.get("cached_tokens", 0)),
                     completion_tokens=int(meta.get("completion_tokens", 0)), finish_reason=kind or "stop",
                     matched_stop=reason.get("matched") if isinstance(reason, dict) else None,
                     prompt_logprobs=prompt_logprobs, rid=meta.get("id"))


def _raise_for_status(status: int, body: bytes, label: str) -> None:
    if status == 200:
        return
    try:
        message = _error_message(json.loads(body))
    except ValueError:
        message = body.decode("utf-8", "replace")[:500]
    raise BackendError(f"{label} failed with HTTP {status}: {message}")


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
        return str(body.get("message", body.get("detail", "")))
    return str(body)


def _describe(prompt: str) -> str:
    if prompt.startswith("batch of "):
        return prompt
    head = prompt[:40].replace("\n", "\\n")
    return f"prompt {head!r}{'...' if len(prompt) > 40 else ''}"


def _load_tokenizer(path: str) -> LocalTokenizer:
    """A checkpoint directory loads with radixserve's Tokenizer (no transformers, no torch); a Hub id with
    transformers."""
    if path and os.path.isdir(path):
        from .runtime import local_tokenizer
        from ..scheduler.tokenizer import Tokenizer

        return local_tokenizer(Tokenizer(path), path)
    return LocalTokenizer.load(path)


# A refused or dropped connection, a timeout (OSError), a malformed reply (HTTPException).
_TRANSPORT_ERRORS = (OSError, http.client.HTTPException)
# What a kept-alive connection that the server closed while idle raises on its next request.
_STALE_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
_MAX_IDLE = 64  # idle connections kept (more are closed when given back)


class _Connections:
    """A pool of keep-alive HTTP/1.1 connections to one server: a request takes an idle one (or opens one) and
    gives it back once its response was read to the end (http.client's connections are not thread-safe, and
    programs send from many threads)."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BackendError(f"{url!r} is not an http:// or https:// URL")
        self._factory = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        self._netloc, self._base = parts.netloc, parts.path.rstrip("/")
        self._headers = headers
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._closed = False

    @contextmanager
    def request(self, method: str, path: str, payload: dict[str, Any] | None
                ) -> Iterator[http.client.HTTPResponse]:
        """The response, to read inside the block."""
        body = json.dumps(payload).encode() if payload is not None else None
        headers = dict(self._headers, **({"Content-Type": "application/json"} if body is not None else {}))
        conn, reused = self._take()
        resp = None
        try:
            try:
                conn.request(method, self._base + path, body=body, headers=headers)
                resp = conn.getresponse()
            except _STALE_ERRORS:
                if not reused:
                    raise
                conn.close()  # the server closed it while it was idle: once more, on a fresh socket
                conn.request(method, self._base + path, body=body, headers=headers)
                resp = conn.getresponse()
            yield resp
        finally:
            if resp is not None and resp.isclosed():
                self._give(conn)
            else:
                conn.close()  # not read to the end (an error, a stream left early): not reusable

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it has an open socket from an earlier request (which may have gone stale)."""
        with self._lock:
            if self._idle:
                conn = self._idle.pop()
                return conn, conn.sock is not None
        return self._factory(self._netloc, timeout=self._timeout_s), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()
