"""Reasoning split out of a model's output: the one owner of `<think>...</think>` parsing (every API uses it).

Parser kinds (`serve --reasoning-parser`, ServerConfig.reasoning_parser):

    qwen3        the output is the answer unless it opens with `<think>` (Qwen3, QwQ with thinking on)
    deepseek-r1  the output starts inside the reasoning, with or without a leading `<think>` (DeepSeek-R1)
    auto         from the chat template's text (`resolve_syntax`): DeepSeek's markers -> deepseek-r1, else a
                 template that mentions `<think>`, `</think>` or `enable_thinking` -> qwen3, else no parser
    (unset)      no splitting: the whole output is the answer

Whatever the kind, the rendered prompt decides where the output starts (`prompt_state`): a prompt that ends
inside an open `<think>` (Qwen3-Thinking, DeepSeek-R1-0528 templates) starts the output in the reasoning; a prompt
that ends with a closed block (Qwen3 with `enable_thinking: false`) makes the whole output the answer (no splitter).

Use, per choice of a request (what the OpenAI and Messages handlers do):

    syntax = resolve_syntax(config.reasoning_parser, tokenizer.chat_template)   # once per server; None: off
    splitter = new_splitter(syntax, tokenizer, prompt_ids)                      # None: all is answer
    for delta in engine deltas:
        reasoning, content = splitter.feed(delta.text, len(delta.token_ids))
    reasoning, content = splitter.finish()
    splitter.reasoning_tokens                                                   # for usage

or, for a finished result at once, `split_output(splitter, text, output_ids, tokenizer)`. In the server,
`ServerState.reasoning` is the syntax and `ServerState.reasoning_plan(prompt_ids, budget)` a ReasoningPlan: the
prompt part done once for a request of n choices, `plan.splitter()` per choice, `plan.sampling()` the engine's
budget fields for its jobs. Request options (efforts, chat_template_kwargs) are read by frontend/reasoning_options.py.

The splitter never hands out part of a tag: text that may still become `<think>` / `</think>` is held back until
the next delta (or finish()) decides it, so a tag split over several tokens is never seen. Whitespace around the
reasoning is trimmed (after `<think>`, before and after `</think>`). Feeding a text in any cut gives the same
concatenated reasoning and content as feeding it at once. Tool calls are parsed on the content only.

Thinking on and off, and its budget:
- `supports_thinking_toggle(template)` says whether a template reads `enable_thinking` (Qwen3's switch);
  `thinking_template_kwargs(enabled, template)` is the template keyword to pass ({} where unsupported or unset).
- `effort_settings(effort)` maps OpenAI's reasoning effort (chat `reasoning_effort`, Responses `reasoning.effort`,
  Messages `output_config.effort`): none / minimal turn thinking off; low / medium / high keep it on with a
  reasoning budget of EFFORT_BUDGETS tokens.
- `budget_params(syntax, budget, splitter)` are the SamplingParams fields that tell the engine where the reasoning
  ends (scheduler/reasoning_budget.py: a grammar, e.g. strict tools' or a response format's, applies to the answer
  only) and cap it (past `budget` reasoning tokens the engine forces the end tag, and the answer follows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

REASONING_PARSERS = ("qwen3", "deepseek-r1", "auto")
OPEN_TAG, CLOSE_TAG = "<think>", "</think>"
# The text the engine forces when a reasoning budget runs out (its stripped form is the end tag).
FORCED_CLOSE = "\n" + CLOSE_TAG + "\n\n"
# Reasoning effort -> reasoning budget in tokens (None: thinking off).
EFFORT_BUDGETS: dict[str, int | None] = {"none": None, "minimal": None, "low": 1024, "medium": 4096, "high": 16384}
REASONING_EFFORTS = tuple(EFFORT_BUDGETS)
_DEEPSEEK_MARKERS = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_PROMPT_TAIL_IDS = 32  # prompt ids decoded to find where the output starts


@dataclass(frozen=True)
class ReasoningSyntax:
    """A parser kind's tags. `forced`: the output starts in the reasoning even when the prompt did not open it."""

    kind: str
    forced: bool = False
    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG


def resolve_syntax(kind: str | None, template: str | Mapping[str, str] | None) -> ReasoningSyntax | None:
    """The syntax of a parser kind (REASONING_PARSERS); `auto` reads the chat template's text. None: no parser."""
    if kind is None:
        return None
    if kind == "auto":
        text = _template_text(template)
        if any(marker in text for marker in _DEEPSEEK_MARKERS) and CLOSE_TAG in text:
            kind = "deepseek-r1"
        elif OPEN_TAG in text or CLOSE_TAG in text or "enable_thinking" in text:
            kind = "qwen3"
        else:
            return None
    if kind not in ("qwen3", "deepseek-r1"):
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {kind!r}")
    return ReasoningSyntax(kind, forced=kind == "deepseek-r1")


def supports_thinking_toggle(template: str | Mapping[str, str] | None) -> bool:
    """Whether the chat template reads `enable_thinking` (so thinking can be turned off per request)."""
    return "enable_thinking" in _template_text(template)


def thinking_template_kwargs(enabled: bool | None, template: str | Mapping[str, str] | None) -> dict[str, Any]:
    """{"enable_thinking": enabled} where the template supports the switch and the request set it; else {}."""
    if enabled is None or not supports_thinking_toggle(template):
        return {}
    return {"enable_thinking": bool(enabled)}


def effort_settings(effort: str | None) -> tuple[bool | None, int | None]:
    """(thinking on/off or None when effort is None, reasoning budget or None). Raises ValueError on an unknown
    effort (the caller names its own field)."""
    if effort is None:
        return None, None
    if effort not in EFFORT_BUDGETS:
        raise ValueError(f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    budget = EFFORT_BUDGETS[effort]
    return budget is not None, budget


def prompt_state(prompt_text: str, syntax: ReasoningSyntax) -> str:
    """Where the prompt leaves the output: "open" (inside a `<think>` block it opened), "closed" (right after a
    closed block: thinking turned off), or "none"."""
    last_open, last_close = prompt_text.rfind(syntax.open_tag), prompt_text.rfind(syntax.close_tag)
    if last_open > last_close:
        return "open"
    if last_close >= 0 and not prompt_text[last_close + len(syntax.close_tag):].strip():
        return "closed"
    return "none"


def new_splitter(syntax: ReasoningSyntax | None, tokenizer: Any, prompt_ids: Sequence[int]
                 ) -> "ReasoningSplitter | None":
    """A splitter for one choice of a request whose prompt is `prompt_ids` (its tail is decoded to see where the
    output starts); None when there is no parser, or when the prompt closed an empty block (thinking turned off:
    the output is all answer, tags the model may still write included)."""
    if syntax is None:
        return None
    tail = tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_IDS:]), skip_special_tokens=False)
    state = prompt_state(tail, syntax)
    if state == "closed":
        return None
    return ReasoningSplitter(syntax, in_reasoning=state == "open" or syntax.forced)


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning: the syntax (None: no parser, the API reports no reasoning), where its output starts
    (`starts_in_reasoning`; None: thinking turned off, the output is all answer) and its budget. Build it with
    plan_reasoning once per prompt; `splitter()` makes one per choice, `sampling()` the engine's budget fields."""

    syntax: ReasoningSyntax | None
    starts_in_reasoning: bool | None
    budget: int | None = None

    def splitter(self) -> "ReasoningSplitter | None":
        if self.syntax is None or self.starts_in_reasoning is None:
            return None
        return ReasoningSplitter(self.syntax, self.starts_in_reasoning)

    def sampling(self) -> dict[str, Any]:
        return budget_params(self.syntax, self.budget, self.splitter())


def plan_reasoning(syntax: ReasoningSyntax | None, tokenizer: Any, prompt_ids: Sequence[int],
                   budget: int | None = None) -> ReasoningPlan:
    """The plan for a prompt (the prompt's tail decoded once, as new_splitter does)."""
    probe = new_splitter(syntax, tokenizer, prompt_ids)
    return ReasoningPlan(syntax, None if probe is None else probe.starts_in_reasoning, budget)


def budget_params(syntax: ReasoningSyntax | None, budget: int | None, splitter: "ReasoningSplitter | None"
                  ) -> dict[str, Any]:
    """SamplingParams fields of an output that reasons (scheduler/reasoning_budget.py): where its reasoning ends (a
    grammar waits for the answer), and with `budget`, the cap on its reasoning tokens. {} when there is no parser or
    the output is all answer."""
    if syntax is None or splitter is None:
        return {}
    out: dict[str, Any] = {"reasoning_end": FORCED_CLOSE,
                           "reasoning_open": None if splitter.starts_in_reasoning else syntax.open_tag}
    if budget is not None:
        out["reasoning_budget"] = budget
    return out


# Splitter states, in the only order they move: a start state, then reasoning, after-close, content.
_START_CONTENT = "start-content"  # nothing decided: a leading open tag would start reasoning
_START_REASONING = "start-reasoning"  # in the reasoning; a leading open tag (repeated by the model) is dropped
_REASONING = "reasoning"
_AFTER_CLOSE = "after-close"  # the close tag was seen: whitespace before the answer is dropped
_CONTENT = "content"
_IN_REASONING = (_START_REASONING, _REASONING)


class ReasoningSplitter:
    """Incremental split of one output stream: feed(text_delta, num_tokens) -> (reasoning_delta, content_delta),
    finish() -> the held-back rest, decided. `reasoning_tokens` counts the tokens of deltas that began inside the
    reasoning (exact when each delta carries one token, as decoding does); `starts_in_reasoning` says where the
    output began; `entered` whether it was ever in the reasoning; `closed` whether the end tag was seen."""

    def __init__(self, syntax: ReasoningSyntax, in_reasoning: bool) -> None:
        self.syntax = syntax
        self.starts_in_reasoning = in_reasoning
        self.state = _START_REASONING if in_reasoning else _START_CONTENT
        self.reasoning_tokens = 0
        self._held = ""  # text not yet handed out (a possible partial tag, or whitespace to trim)
        self._pending_tokens = 0  # tokens of an undecided start
        self._reasoning_out = False  # reasoning text handed out already (its leading whitespace is gone)
        self._closed = False

    @property
    def entered(self) -> bool:
        return self.state in _IN_REASONING or self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        began = self.state
        self._held += text
        out = self._advance(final=False)
        if began == _START_CONTENT:
            self._pending_tokens += num_tokens
            if self.state != _START_CONTENT:
                num_tokens, self._pending_tokens = self._pending_tokens, 0
                self.reasoning_tokens += num_tokens if self.entered else 0
        elif began in _IN_REASONING:
            self.reasoning_tokens += num_tokens
        return out

    def finish(self) -> tuple[str, str]:
        """Everything still held back, decided as the output ended."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            state = self.state
            r, c = {_START_CONTENT: self._start, _START_REASONING: self._start, _REASONING: self._reasoning,
                    _AFTER_CLOSE: self._after_close, _CONTENT: self._content}[state](final)
            reasoning.append(r)
            content.append(c)
            if self.state == state:  # each step either moves on or has used (or must wait for) all it can
                return "".join(reasoning), "".join(content)

    def _start(self, final: bool) -> tuple[str, str]:
        open_tag = self.syntax.open_tag
        stripped = self._held.lstrip()
        if stripped.startswith(open_tag):
            self._held = stripped[len(open_tag):]
            self.state = _REASONING
        elif final or not open_tag.startswith(stripped):  # not (whitespace and) a partial open tag: decided
            self.state = _REASONING if self.state == _START_REASONING else _CONTENT
        return "", ""

    def _reasoning(self, final: bool) -> tuple[str, str]:
        close = self.syntax.close_tag
        if not self._reasoning_out:
            self._held = self._held.lstrip()
        at = self._held.find(close)
        if at >= 0:
            text, self._held = self._held[:at].rstrip(), self._held[at + len(close):]
            self.state, self._closed = _AFTER_CLOSE, True
        elif final:
            text, self._held = self._held.rstrip(), ""
        else:
            keep = _held_suffix(self._held, close)
            text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self._reasoning_out = self._reasoning_out or bool(text)
        return text, ""

    def _after_close(self, final: bool) -> tuple[str, str]:
        self._held = self._held.lstrip()
        if self._held:
            self.state = _CONTENT
        return "", ""

    def _content(self, final: bool) -> tuple[str, str]:
        text, self._held = self._held, ""
        return "", text


def _held_suffix(text: str, tag: str) -> int:
    """How many trailing characters to hold back: a suffix that is a proper prefix of `tag`, and the whitespace
    before it (trimmed if the tag follows)."""
    keep = 0
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            keep = n
            break
    body = text[:len(text) - keep]
    return keep + (len(body) - len(body.rstrip()))


def split_output(splitter: ReasoningSplitter, text: str, output_ids: Sequence[int], tokenizer: Any
                 ) -> tuple[str, str]:
    """(reasoning, content) of a finished output at once. splitter.reasoning_tokens becomes the number of output
    tokens up to the one that completed the end tag (all of them when the reasoning never closed; 0 when the output
    never entered it), as a one-token-per-delta stream counts them."""
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    splitter.reasoning_tokens = reasoning_token_count(splitter.syntax, splitter.starts_in_reasoning, output_ids,
                                                      tokenizer) if splitter.entered else 0
    return r1 + r2, c1 + c2


def reasoning_token_count(syntax: ReasoningSyntax, starts_in_reasoning: bool, output_ids: Sequence[int],
                          tokenizer: Any) -> int:
    """The least k such that output_ids[:k] closes the reasoning (len(output_ids) when none does), by binary
    search over decoded prefixes (closing is monotone in k): O(log n) decodes."""
    def closes(k: int) -> bool:
        probe = ReasoningSplitter(syntax, starts_in_reasoning)
        probe.feed(tokenizer.decode(list(output_ids[:k]), skip_special_tokens=False))
        return probe.closed

    lo, hi = 0, len(output_ids)
    if not closes(hi):
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        if closes(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _template_text(template: str | Mapping[str, str] | None) -> str:
    if template is None:
        return ""
    if isinstance(template, str):
        return template
    return "\n".join(str(v) for v in template.values())
