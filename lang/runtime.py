"""Runtime: the DSL over an in-process Engine.

Requests go through the engine's thread-safe submission (`add_request(..., on_delta=...)`) to
its background step loop, so programs running in different threads land in the same batches.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from .backend import Backend, BackendError, GenOutput, LocalTokenizer, TextCallback
from .roles import ChatTemplate

logger = logging.getLogger(__name__)


class Runtime(Backend):
    """`Runtime(model_path=None, **engine_config)` starts an Engine (None = the built-in demo
    model); `Runtime(engine=existing)` shares one. `shutdown()` stops only an engine it started.

    ``engine_config`` are EngineConfig fields: ``Runtime(num_threads=1)`` sets the engine's torch
    intra-op threads, unlike ``prog.run_batch(num_threads=)``, which is how many programs run at
    once."""

    name = "Runtime"

    def __init__(self, model_path: str | None = None, *, engine: Any = None, **engine_config: Any) -> None:
        if engine is not None and (model_path is not None or engine_config):
            raise ValueError("pass either engine= or model_path/engine config, not both")
        self._owns_engine = engine is None
        if engine is None:
            from ..scheduler import Engine

            engine = Engine(model_path, **engine_config)
        self.engine = engine
        self.engine.start()
        self._tokenizer = _local_tokenizer(engine)

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._tokenizer.template

    def prompt_text(self, text: str) -> str:
        return self._tokenizer.prompt_text(text)

    def encode(self, text: str) -> list[int]:
        return list(self.engine.tokenizer.encode(self.prompt_text(text), add_special_tokens=True))

    def generate(self, prompt: str, params: dict[str, Any], on_text: TextCallback | None = None) -> GenOutput:
        return self._wait(self._submit(prompt, params, on_text))

    def generate_batch(self, prompts: list[str], params: list[dict[str, Any]]) -> list[GenOutput]:
        # Submit all before waiting on any, so that they enter the same step.
        pending = [self._submit(p, sp, None) for p, sp in zip(prompts, params)]
        return [self._wait(item) for item in pending]

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()

    def open_session(self) -> str | None:
        return self.engine.open_session()

    def close_session(self, session_id: str) -> None:
        self.engine.close_session(session_id)

    def _submit(self, prompt: str, params: dict[str, Any], on_text: TextCallback | None) -> "_Pending":
        pending = _Pending(on_text)
        try:
            pending.rid = self.engine.add_request(self.prompt_text(prompt), dict(params), on_delta=pending.on_delta)
        except ValueError as exc:
            raise BackendError(f"request ({_describe(prompt)}) rejected by the engine: {exc}") from exc
        return pending

    def _wait(self, pending: "_Pending") -> GenOutput:
        pending.done.wait()
        result = pending.result
        if result is None or result.error or result.finish_reason == "abort":
            cause = (result.error if result is not None else None) or "aborted"
            raise BackendError(f"request {pending.rid} failed in the engine: {cause}")
        prompt_logprobs = None
        if result.prompt_logprobs is not None:
            prompt_logprobs = [lp.logprob for lp in result.prompt_logprobs]
        return GenOutput(text=result.text, output_ids=list(result.output_ids), prompt_tokens=result.prompt_tokens,
                         cached_tokens=result.cached_tokens, completion_tokens=result.completion_tokens,
                         finish_reason=result.finish_reason, matched_stop=result.matched_stop,
                         prompt_logprobs=prompt_logprobs, rid=result.rid)


class _Pending:
    """One submitted request: deltas arrive on the engine's loop thread."""

    def __init__(self, on_text: TextCallback | None) -> None:
        self.rid: str | None = None
        self.on_text = on_text
        self.done = threading.Event()
        self.result: Any = None

    def on_delta(self, delta: Any) -> None:
        try:
            if self.on_text is not None and delta.text:
                self.on_text(delta.text)
        finally:
            if delta.finished:
                self.result = delta.result
                self.done.set()


def _local_tokenizer(engine: Any) -> LocalTokenizer:
    tokenizer = engine.tokenizer
    if hasattr(tokenizer, "render_chat"):  # radixserve's Tokenizer: no transformers needed
        return local_tokenizer(tokenizer, engine.model_path)
    return LocalTokenizer.load(engine.model_path)


def local_tokenizer(tokenizer: Any, name: str) -> LocalTokenizer:
    """LocalTokenizer over a radixserve.scheduler.tokenizer.Tokenizer (which matches transformers' outputs)."""
    return LocalTokenizer(_TransformersView(tokenizer, name), name)


class _TransformersView:
    """The part of a transformers tokenizer that LocalTokenizer and ChatTemplate.from_tokenizer read, over a
    radixserve Tokenizer: BOS text and id, encode, chat_template and apply_chat_template(tokenize=False)."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer
        self.name_or_path = name
        self.bos_token = tokenizer.bos_token
        self.bos_token_id = tokenizer.bos_token_id
        self.chat_template = tokenizer.chat_template if tokenizer.has_chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        if tokenize:
            return self._tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self._tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _describe(prompt: str) -> str:
    head = prompt[:40].replace("\n", "\\n")
    return f"prompt {head!r}{'...' if len(prompt) > 40 else ''}, {len(prompt)} chars"
