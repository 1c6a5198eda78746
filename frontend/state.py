"""ServerState: what every handler needs (the engine process, config, admission, metrics, token texts)."""
from __future__ import annotations

import functools
import os
import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import ServerConfig
from .engine_client import EngineClient, Job
from .errors import APIError, bad_request
from .logprobs import TokenTexts
from .metrics import ServerMetrics
from .reasoning import ReasoningPlan, ReasoningSyntax, plan_reasoning, resolve_syntax
from .response_store import ResponseStore
from .salt_policy import resolve_salt
from .tenants import Tenants
from .thinking_signature import signing_key
from ..scheduler.gc_freeze import FullPasses
from ..scheduler.sampling_params import SamplingParams, choice_rids, choice_seed

# sglang-router 0.3.2 re-serializes a request that names no model with this one: absent, as on a single server.
ROUTER_NO_MODEL = "unknown"


@dataclass
class ServerState:
    engine: Any  # an EngineProcess (frontend.engine_proc); its tokenizer lives in this process
    config: ServerConfig
    client: EngineClient
    metrics: ServerMetrics
    model_name: str
    texts: TokenTexts
    created: int
    responses: ResponseStore  # stored /v1/responses
    tenants: Tenants = field(default_factory=Tenants)  # API keys -> tenants (no keys: everyone is "default")
    rng: random.Random = field(default_factory=random.Random)
    gc: FullPasses = field(default_factory=FullPasses)  # this process's full collections (scheduler/gc_freeze.py)

    def check_model(self, model: str | None) -> None:
        """Unknown model names get 404; an absent `model` means the served one."""
        path = self.engine.info.model_path
        if model is None or model in (ROUTER_NO_MODEL, self.model_name, path) \
                or os.path.normpath(model) == os.path.normpath(path):
            return
        raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                       param="model", code="model_not_found")

    @functools.cached_property
    def reasoning(self) -> ReasoningSyntax | None:
        """The reasoning parser's syntax (`--reasoning-parser`, frontend/reasoning.py); None: no splitting."""
        return resolve_syntax(self.config.reasoning_parser, self.engine.tokenizer.chat_template)

    def reasoning_plan(self, prompt_ids: list[int], budget: int | None = None) -> ReasoningPlan:
        """The reasoning of a request with this prompt: splitters per choice, the engine's budget fields."""
        return plan_reasoning(self.reasoning, self.engine.tokenizer, prompt_ids, budget)

    @property
    def structured(self) -> bool:
        """The engine can compile grammars: xgrammar is installed (what changes without: frontend/structured.py)."""
        return self.engine.info.structured

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def base_seed(self, seed: int | None) -> int:
        """Choice i samples with base + i; without a seed each request draws its own base."""
        return seed if seed is not None else self.rng.getrandbits(62)

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return list(self.engine.tokenizer.encode(text, add_special_tokens=True))
        except Exception as exc:  # a tokenizer refusing the text is the client's input problem
            raise bad_request(f"could not tokenize {param}: {exc}", param) from exc

    @functools.cached_property
    def thinking_key(self) -> bytes:
        """The key signing /v1/messages thinking blocks (frontend/thinking_signature.py), fixed at start-up."""
        return signing_key(self.config.thinking_key)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """`template_kwargs`: the template's own switches (enable_thinking)."""
        try:
            ids = self.engine.tokenizer.apply_chat_template(messages, tools=tools,
                                                            add_generation_prompt=add_generation_prompt,
                                                            **template_kwargs)
        except Exception as exc:  # template errors (e.g. a role order it refuses) are input errors
            raise bad_request(f"the chat template could not render these messages: {exc}", "messages") from exc
        return list(ids)

    def make_jobs(self, prompt_ids: list[int], sampling: dict[str, Any], n: int, rid: str,
                  seed: int | None, param_names: dict[str, str], system: Callable[[], int] | None = None,
                  **overrides: Any) -> list[Job]:
        """The n choices of one prompt, one Job each; choice i uses seed base + i. The engine gets them as one
        request (EngineClient.submit), and names and seeds them by the same rule. `system`: where the prompt's system
        part ends (computed only if the salt needs it: frontend/salt_policy.py); None for a prompt without one."""
        sampling = dict(sampling)
        resolve_salt(self, sampling, system)
        base = self.base_seed(seed)
        return [Job(prompt_ids=prompt_ids, params=SamplingParams(**dict(sampling, seed=choice_seed(base, i),
                                                                          **overrides)),
                    rid=choice_rid, param_names=param_names, group=(rid, n))
                for i, choice_rid in enumerate(choice_rids(rid, n))]
