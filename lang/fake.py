"""A deterministic in-memory backend for testing programs without a model.

Token ids are the characters' code points. The "model" continues a prompt with words picked by
a hash of the prompt; a choice's logprob is a hash of (recent context, character). A prefix
cache over every prompt + output it saw reports cached_tokens the way the engine does (capped at
len - 1 and at logprob_start_len).

Structured gens, simply: for a typed gen's regex (ir.TYPE_REGEXES) the default "model" answers a
value of that type chosen by the prompt's hash. The fake never constrains anything else: any other
`regex` must be fully matched (Python `re`) by what `respond` returns, and a `json_schema` gen's
answer must parse as JSON (the schema itself is not checked), else the request is rejected with a
ValueError saying so (pass `respond=` that answers such prompts); `ebnf` is always rejected.
"""
from __future__ import annotations

import json
import re
import threading
import time
import zlib
from typing import Any, Callable

from .backend import Backend, GenOutput, TextCallback
from .ir import TYPE_REGEXES
from .roles import ChatTemplate

WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta")
_DTYPE_OF_REGEX = {regex: dtype for dtype, regex in TYPE_REGEXES.items()}

RespondFn = Callable[[str, dict[str, Any]], str]
ScoreFn = Callable[[str, str], float]


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def default_respond(prompt: str, params: dict[str, Any]) -> str:
    """Words chosen by the prompt's hash, a newline after every third; for a typed gen's regex, a
    value of that type chosen by the hash."""
    seed = zlib.crc32(prompt.encode())
    dtype = _DTYPE_OF_REGEX.get(params.get("regex"))
    if dtype is not None:
        return _typed_text(dtype, seed)
    words = []
    for i in range(64):
        seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
        words.append(" " + WORDS[seed % len(WORDS)] + ("\n" if i % 3 == 2 else ""))
    return "".join(words)


def _typed_text(dtype: str, seed: int) -> str:
    if dtype == "int":
        return str(seed % 20001 - 10000)
    if dtype == "float":
        return f"{'-' if seed & 1 else ''}{(seed >> 1) % 1000}.{(seed >> 11) % 100:02d}"
    if dtype == "bool":
        return "True" if seed & 1 else "False"
    return '"' + WORDS[seed % len(WORDS)] + '"'


def check_constraint(text: str, params: dict[str, Any]) -> None:
    """Reject a response that does not meet the request's regex / json_schema (see the module doc)."""
    if params.get("ebnf") is not None:
        raise ValueError("the fake backend does not support ebnf")
    regex = params.get("regex")
    if regex is not None:
        try:
            matched = re.fullmatch(regex, text)
        except re.error as exc:
            raise ValueError(f"invalid regex: {exc}") from None
        if matched is None:
            raise ValueError(f"the fake backend does not constrain generation, and its answer {text[:40]!r} does "
                             f"not match regex {regex!r}; pass FakeBackend(respond=...) that answers with a match")
    schema = params.get("json_schema")
    if schema is not None:
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
        try:
            json.loads(text)
        except ValueError:
            raise ValueError(f"the fake backend does not constrain generation, and its answer {text[:40]!r} is not "
                             "JSON (it checks only that the answer parses, not the schema); pass "
                             "FakeBackend(respond=...) that answers with JSON") from None


def default_score(context: str, char: str) -> float:
    return -1.0 - (zlib.crc32((context[-8:] + char).encode()) % 100) / 50.0


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, respond: RespondFn = default_respond, score: ScoreFn = default_score,
                 template: ChatTemplate | None = None, latency_s: float = 0.0) -> None:
        self._respond = respond
        self._score = score
        self._template = template if template is not None else ChatTemplate(chatml, "fake-chatml")
        self._latency_s = latency_s
        self._lock = threading.Lock()
        self._seen: list[str] = []  # every prompt + output, for cached_tokens
        self.sent: list[tuple[str, dict[str, Any]]] = []  # every request, in arrival order
        self.num_in_flight = 0
        self.max_in_flight = 0  # most requests in flight at once: > 1 means programs overlapped

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def generate(self, prompt: str, params: dict[str, Any], on_text: TextCallback | None = None) -> GenOutput:
        if not prompt:
            raise ValueError("the prompt is empty")
        with self._lock:
            self.sent.append((prompt, dict(params)))
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
            cached = self._cached_len(prompt, params.get("logprob_start_len"))
        text = ""
        try:
            if self._latency_s:
                time.sleep(self._latency_s)
            text, reason, matched = self._continue(prompt, params)
        finally:
            with self._lock:
                self.num_in_flight -= 1
                self._seen.append(prompt + text)
        if on_text is not None:
            for i in range(0, len(text), 3):
                on_text(text[i:i + 3])
        start = params.get("logprob_start_len")
        logprobs = None
        if start is not None:
            logprobs = [self._score(prompt[:i], prompt[i]) for i in range(max(1, start), len(prompt))]
        return GenOutput(text=text, output_ids=self.encode(text), prompt_tokens=len(prompt), cached_tokens=cached,
                         completion_tokens=len(text), finish_reason=reason, matched_stop=matched,
                         prompt_logprobs=logprobs)

    def generate_batch(self, prompts: list[str], params: list[dict[str, Any]]) -> list[GenOutput]:
        return [self.generate(p, sp) for p, sp in zip(prompts, params)]

    def _continue(self, prompt: str, params: dict[str, Any]) -> tuple[str, str, str | None]:
        max_new = params.get("max_new_tokens", 128)
        full = self._respond(prompt, params)
        check_constraint(full, params)
        text = full[:max_new]
        hits = [(text.find(stop), stop) for stop in params.get("stop", []) if stop in text]
        if hits:
            idx, stop = min(hits)
            return text[:idx], "stop", stop
        return text, "length" if len(full) > max_new or len(text) == max_new else "stop", None

    def _cached_len(self, prompt: str, logprob_start_len: int | None) -> int:
        best = 0
        for seen in self._seen:
            n = 0
            for a, b in zip(seen, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        cap = len(prompt) - 1 if logprob_start_len is None else min(len(prompt) - 1, logprob_start_len)
        return min(best, cap)
