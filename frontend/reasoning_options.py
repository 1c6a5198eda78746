"""A request's reasoning options, as the OpenAI APIs spell them, read into one ReasoningOptions (bad values are 400s
naming the client's field). Chat: `reasoning_effort`, `chat_template_kwargs` and `thinking_token_budget` (vLLM's
name: a reasoning budget in tokens, over the effort's); Responses: `reasoning.effort`.
Efforts map through frontend/reasoning.effort_settings (none / minimal: thinking off; low / medium / high: on, with
EFFORT_BUDGETS reasoning tokens)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import bad_request
from .fields import FieldReader
from .reasoning import effort_settings, thinking_template_kwargs

# Template variables a client may not set through chat_template_kwargs: the server renders them itself.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "chat_template")


@dataclass(frozen=True)
class ReasoningOptions:
    thinking: bool | None = None  # None: the template's default
    budget: int | None = None  # reasoning tokens (frontend/reasoning.budget_params); None: no cap
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # the client's own chat_template_kwargs

    def render_kwargs(self, template: str | Mapping[str, str] | None) -> dict[str, Any]:
        """Keywords for the chat template: the thinking switch where the template has one, the client's own
        chat_template_kwargs winning."""
        return {**thinking_template_kwargs(self.thinking, template), **self.template_kwargs}

    def effective_budget(self) -> int | None:
        """No budget once thinking is off (by effort or by the client's enable_thinking)."""
        if self.thinking is False or self.template_kwargs.get("enable_thinking") is False:
            return None
        return self.budget


def read_effort(reader: FieldReader, key: str) -> ReasoningOptions:
    """An effort field (chat's reasoning_effort, the Responses API's reasoning.effort) as thinking and budget."""
    value = reader.raw(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"{reader.name(key)} must be a string", reader.name(key))
    try:
        thinking, budget = effort_settings(value)
    except ValueError as exc:
        raise bad_request(f"{reader.name(key)} {exc}", reader.name(key)) from None
    return ReasoningOptions(thinking=thinking, budget=budget)


def read_chat_reasoning(reader: FieldReader) -> ReasoningOptions:
    """Chat completions: reasoning_effort, thinking_token_budget and chat_template_kwargs (an object of template
    variables, e.g. {"enable_thinking": false})."""
    options = read_effort(reader, "reasoning_effort")
    budget = reader.int("thinking_token_budget", None, lo=1)
    if budget is not None:
        options = ReasoningOptions(options.thinking, budget)
    raw = reader.raw("chat_template_kwargs")
    if raw is None:
        return options
    if not isinstance(raw, dict):
        raise bad_request("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
    reserved = sorted(set(raw) & set(RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (the server renders those)",
                          "chat_template_kwargs")
    if "enable_thinking" in raw and not isinstance(raw["enable_thinking"], bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs")
    return ReasoningOptions(options.thinking, options.budget, dict(raw))
