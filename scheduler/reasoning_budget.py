"""The reasoning part of an output in the engine: where it ends, its budget, and grammars held off while it runs.

A request whose output reasons (`<think>...</think>` before the answer) says so in its SamplingParams (the frontend
fills them: frontend/reasoning.budget_params):

    reasoning_end     the end-of-thinking text (e.g. "\\n</think>\\n\\n"); its stripped form is the end tag whose
                      appearance in the output ends the reasoning; None: the output does not reason
    reasoning_budget  N >= 1: reasoning tokens allowed, counted from the output's first token (an opening tag the
                      model writes counts); None: no budget
    reasoning_open    None: the output starts inside the reasoning (the prompt opened it); else the tag the output
                      must begin with (leading whitespace aside) for the reasoning to start; an output that begins
                      otherwise never reasons and the budget never applies

Budget: when the reasoning reaches N tokens and the model has not closed it, the engine appends reasoning_end's
tokens itself and the answer follows (what Anthropic's `thinking.budget_tokens` and reasoning efforts ask for).
Forced tokens are output tokens like sampled ones, appended the way jump-forward appends a grammar's forced tokens
(scheduler/jump_forward.py): right after a sampled token, without KV, never streamed yet; the next step computes
them as one extend. Each goes through the output processor's stop, length and context checks; their logprob (when
asked for) is 0, the token itself being certain.

Grammars: a constrained request's grammar (a response format, a tool-call structural tag) is for the answer, so
while the output is inside its reasoning the grammar is held: no mask, its matcher sees none of those tokens, and
it takes up at the first token after the end tag (`grammar_active`). Before an output has opened its reasoning
(reasoning_open still possible) the grammar is active: a grammar that refuses the opening tag keeps the model from
reasoning. Owner: ReasoningBudget (one per engine); per-request state: Req.reasoning (_ReasoningState), None once
the reasoning has ended (or never started).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernels.forward_io import TokenLogprob
from .output import OutputProcessor
from .req import Req


def grammar_active(req: Req) -> bool:
    """Whether the request's grammar (if any) constrains its next token: not while it is inside its reasoning."""
    return req.grammar is not None and (req.reasoning is None or req.reasoning.open_tag is not None)


@dataclass
class _ReasoningState:
    end_ids: list[int]
    end_tag: str
    open_tag: str | None  # None once the reasoning has started (or from the start)
    scanned: int = 0  # chars of req.text searched for the end tag


class ReasoningBudget:
    """The engine's one owner of output reasoning (see the module docstring): attach() at admission, after_token()
    after every sampled token, grammar_active() wherever a grammar would act."""

    def __init__(self, tokenizer: Any, outputs: OutputProcessor) -> None:
        self.tokenizer = tokenizer
        self.outputs = outputs
        self._ids: dict[str, list[int]] = {}  # reasoning_end text -> its tokens

    def attach(self, req: Req) -> None:
        """Give a new request its reasoning state (none when its output does not reason)."""
        p = req.params
        if p.reasoning_end is None:
            return
        ids = self._ids.get(p.reasoning_end)
        if ids is None:
            ids = self._ids[p.reasoning_end] = list(self.tokenizer.encode(p.reasoning_end, add_special_tokens=False))
        req.reasoning = _ReasoningState(ids, p.reasoning_end.strip(), p.reasoning_open)

    def after_token(self, req: Req) -> None:
        """Called after each sampled token is appended (through the grammar or not): ends the state when the
        reasoning closed (or never started), and appends the end tokens when a budget is spent."""
        state = req.reasoning
        if state is None or req.finish_reason is not None:
            return
        if state.open_tag is not None and not self._opened(req, state):
            return
        at = req.text.find(state.end_tag, max(0, state.scanned - len(state.end_tag) + 1))
        state.scanned = len(req.text)
        if at >= 0:
            req.reasoning = None  # closed by the model
            return
        budget = req.params.reasoning_budget
        if budget is None or len(req.output_ids) < budget:
            return
        req.reasoning = None
        want = req.params.logprobs
        for tok in state.end_ids:
            if req.finish_reason is not None:
                break
            logprob = TokenLogprob(tok, 0.0, [(tok, 0.0)][:want]) if want is not None else None
            self.outputs.append_token(req, tok, logprob)

    @staticmethod
    def _opened(req: Req, state: _ReasoningState) -> bool:
        """Whether the output has opened its reasoning; drops the budget once it is clear it never will."""
        head = req.text.lstrip()
        if head.startswith(state.open_tag):
            state.open_tag = None
            return True
        if not state.open_tag.startswith(head):
            req.reasoning = None
        return False
