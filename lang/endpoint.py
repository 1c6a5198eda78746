"""Endpoint: the DSL over HTTP, speaking SGLang's native `/generate` (ARCHITECTURE §5).

The chat template and the tokenizer (for `select`'s token positions) are loaded on the client
from the server's `/get_model_info` tokenizer_path, or from `tokenizer_path=` when the server's
path is not readable here.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import httpx

from radixserve.lang.backend import Backend, BackendError, GenOutput, LocalTokenizer, TextCallback
from radixserve.lang.roles import ChatTemplate

logger = logging.getLogger(__name__)

# Fields that sit beside sampling_params in a /generate request rather than inside it.
_LOGPROB_KEYS = ("logprob_start_len",)


class Endpoint(Backend):
    name = "Endpoint"

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
                 tokenizer_path: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # httpx.Client is safe to share between threads; its pool bounds open connections.
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, limits=limits)
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
        if any(s.get("return_logprob") for s in singles):
            payload["return_logprob"] = True
            payload["logprob_start_len"] = [s.get("logprob_start_len", -1) for s in singles]
            payload["top_logprobs_num"] = 0
        body = self._post(payload, f"batch of {len(prompts)} prompts")
        if not isinstance(body, list) or len(body) != len(prompts):
            raise BackendError(f"{self.url}/generate answered a batch of {len(prompts)} with {str(body)[:200]}")
        return [_parse(item, p, self.url) for item, p in zip(body, prompts)]

    def shutdown(self) -> None:
        self._client.close()

    # --- HTTP -------------------------------------------------------------------------------

    def _get(self, path: str) -> dict[str, Any]:
        try:
            resp = self._client.get(path)
        except httpx.HTTPError as exc:
            raise BackendError(f"GET {self.url}{path} failed: {type(exc).__name__}: {exc}") from exc
        _raise_for_status(resp, f"GET {self.url}{path}")
        return resp.json()

    def _post(self, payload: dict[str, Any], what: str) -> Any:
        try:
            resp = self._client.post("/generate", json=payload)
        except httpx.HTTPError as exc:
            raise BackendError(f"POST {self.url}/generate ({_describe(what)}) failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        _raise_for_status(resp, f"POST {self.url}/generate ({_describe(what)})")
        return resp.json()

    def _stream(self, payload: dict[str, Any], prompt: str, on_text: TextCallback) -> GenOutput:
        label = f"POST {self.url}/generate ({_describe(prompt)}, stream)"
        last: dict[str, Any] | None = None
        sent_len = 0
        try:
            with self._client.stream("POST", "/generate", json=payload) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _raise_for_status(resp, label)
                for line in resp.iter_lines():
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
        except httpx.HTTPError as exc:
            raise BackendError(f"{label} failed: {type(exc).__name__}: {exc}") from exc
        if last is None:
            raise BackendError(f"{label} ended without a result")
        return _parse(last, prompt, self.url)


def _payload(prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    sampling = {k: v for k, v in params.items() if k not in _LOGPROB_KEYS}
    if isinstance(sampling.get("json_schema"), dict):
        # SGLang's /generate takes the schema as a JSON string; its key order is the output's.
        sampling["json_schema"] = json.dumps(sampling["json_schema"], ensure_ascii=False)
    payload: dict[str, Any] = {"text": prompt, "sampling_params": sampling}
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


def _raise_for_status(resp: httpx.Response, label: str) -> None:
    if resp.status_code == 200:
        return
    try:
        message = _error_message(resp.json())
    except ValueError:
        message = resp.text[:500]
    raise BackendError(f"{label} failed with HTTP {resp.status_code}: {message}")


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
        from radixserve.lang.runtime import local_tokenizer
        from radixserve.scheduler.tokenizer import Tokenizer

        return local_tokenizer(Tokenizer(path), path)
    return LocalTokenizer.load(path)
