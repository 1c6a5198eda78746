"""The interface every DSL backend implements, and the choice scoring built on it.

A backend turns prompt text into generations. Prompts are sent as text; the engine tokenizes
them as transformers would (`add_special_tokens=True`). The backend also knows the tokenizer, so
that `select` can say where each choice starts in token positions and the chat template can be
rendered on the client side.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from .roles import ChatTemplate

logger = logging.getLogger(__name__)

TextCallback = Callable[[str], None]


class BackendError(RuntimeError):
    """A request the backend rejected or failed; the message names the request and the cause."""


@dataclass
class GenOutput:
    text: str
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    # Logprob of each prompt token from logprob_start_len on (position 0 never has one).
    prompt_logprobs: list[float] | None = None
    rid: str | None = None


@dataclass
class RequestRecord:
    """One request a program sent: what, and what came back (for hit-rate accounting)."""

    kind: str  # "gen" | "select" | "prefix"
    prompt: str  # the program text it was built from; backend.encode(prompt) gives the ids the engine saw
    output: GenOutput
    call_idx: int = 0  # which backend call of its state (a select's prompts share one)


@dataclass
class ChoiceScores:
    choices: list[str]
    sum_logprobs: list[float]
    normalized_logprobs: list[float]
    num_tokens: list[int]
    records: list[RequestRecord] = field(default_factory=list)


class Backend(ABC):
    """Generation over one model. Implementations must be safe to call from many threads at once:
    the DSL runs programs (and fork branches) in threads, and their requests should batch."""

    name: str = "backend"

    @abstractmethod
    def generate(self, prompt: str, params: dict[str, Any], on_text: TextCallback | None = None) -> GenOutput:
        """One request. `params` uses SamplingParams names (incl. logprob_start_len).
        `on_text` receives the new text as it streams (stop strings never reach it)."""

    @abstractmethod
    def generate_batch(self, prompts: list[str], params: list[dict[str, Any]]) -> list[GenOutput]:
        """Several requests submitted together, so that the engine can batch them."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids the engine computes for program text `text` (after prompt_text)."""

    def prompt_text(self, text: str) -> str:
        """The text sent to the engine for program text `text` (see strip_added_bos)."""
        return text

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate | None:
        """The model's chat template, or None if it has none."""

    def shutdown(self) -> None:
        """Release what the backend holds (threads, connections, an owned engine)."""

    def open_session(self) -> str | None:
        """A session for one program run (its requests' histories stay cached between its calls); None when the
        backend has no sessions."""
        return None

    def close_session(self, session_id: str) -> None:
        """End a session open_session gave (the run returned)."""

    # --- built on the primitives above -------------------------------------------------------

    def prefill_only(self, prompt: str) -> GenOutput:
        """Compute and cache the prompt without generating (max_new_tokens=0)."""
        return self.generate(prompt, {"max_new_tokens": 0})

    def score_choices(self, prefix: str, choices: list[str]) -> ChoiceScores:
        """Logprob of each choice's tokens after `prefix`, in one batched request.

        Each prompt is prefix + choice, tokenized as a whole (what the model would read next);
        scoring starts at the first token that differs from the prefix alone. logprob_start_len
        sits there, so every prompt's shared prefix is matched in (and added to) the cache.
        """
        prefix_ids = self.encode(prefix)
        prompts, starts, num_tokens = [], [], []
        for choice in choices:
            full_ids = self.encode(prefix + choice)
            start = _common_prefix_len(prefix_ids, full_ids)
            start = max(1, min(start, len(full_ids) - 1))  # score >= 1 token; position 0 has no logprob
            prompts.append(prefix + choice)
            starts.append(start)
            num_tokens.append(len(full_ids) - start)
        params = [{"max_new_tokens": 0, "logprob_start_len": start} for start in starts]
        outputs = self.generate_batch(prompts, params)
        sums, records = [], []
        for choice, out, n, prompt in zip(choices, outputs, num_tokens, prompts):
            if out.prompt_logprobs is None or len(out.prompt_logprobs) != n:
                got = None if out.prompt_logprobs is None else len(out.prompt_logprobs)
                raise BackendError(f"{self.name}: scoring choice {choice!r} expected {n} prompt logprobs, "
                                   f"got {got} (does the engine tokenize like the client?)")
            sums.append(float(sum(out.prompt_logprobs)))
            records.append(RequestRecord("select", prompt, out))
        normalized = [s / max(1, n) for s, n in zip(sums, num_tokens)]
        return ChoiceScores(list(choices), sums, normalized, num_tokens, records)


class LocalTokenizer:
    """The model's transformers tokenizer on the client side: chat template, BOS handling, ids."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.hf = tokenizer
        self.name = name
        self.bos_token, self.adds_bos = tokenizer_adds_bos(tokenizer)
        try:
            self.template: ChatTemplate | None = ChatTemplate.from_tokenizer(tokenizer, name)
        except ValueError:
            self.template = None

    @classmethod
    def load(cls, path: str) -> "LocalTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), path)

    def prompt_text(self, text: str) -> str:
        return strip_added_bos(text, self.bos_token, self.adds_bos)

    def encode(self, text: str) -> list[int]:
        """Ids of program text as the engine gets it (BOS stripped, then add_special_tokens=True)."""
        return list(self.hf.encode(self.prompt_text(text), add_special_tokens=True))


def strip_added_bos(text: str, bos_token: str | None, adds_bos: bool) -> str:
    """Drop a template-rendered BOS when the engine will add one itself while tokenizing.

    Chat templates often start with the BOS text; transformers tokenizes such renderings with
    add_special_tokens=False, while a text prompt to the engine gets add_special_tokens=True.
    Without this, the model would read two BOS tokens.
    """
    if adds_bos and bos_token and text.startswith(bos_token):
        return text[len(bos_token):]
    return text


def tokenizer_adds_bos(tokenizer: Any) -> tuple[str | None, bool]:
    """(bos_token text, whether encoding with special tokens prepends it) of an HF-like tokenizer."""
    bos_token = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if bos_token is None or bos_id is None:
        return bos_token, False
    ids = tokenizer.encode("x", add_special_tokens=True)
    return bos_token, bool(ids) and ids[0] == bos_id


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
