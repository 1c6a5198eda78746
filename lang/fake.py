"""A deterministic in-memory backend for testing programs without a model.

Token ids are the characters' code points. The "model" continues a prompt with words picked by
a hash of the prompt; a choice's logprob is a hash of (recent context, character). A prefix
cache over every prompt + output it saw reports cached_tokens the way the engine does (capped at
len - 1 and at logprob_start_len).
"""
from __future__ import annotations

import threading
import time
import zlib
from typing import Any, Callable

from radixserve.lang.backend import Backend, GenOutput, TextCallback
from radixserve.lang.roles import ChatTemplate

WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta")

RespondFn = Callable[[str, dict[str, Any]], str]
ScoreFn = Callable[[str, str], float]


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def default_respond(prompt: str, params: dict[str, Any]) -> str:
    """Words chosen by the prompt's hash, a newline after every third."""
    seed = zlib.crc32(prompt.encode())
    words = []
    for i in range(64):
        seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
        words.append(" " + WORDS[seed % len(WORDS)] + ("\n" if i % 3 == 2 else ""))
    return "".join(words)


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
