"""Reasoning budget: a request may cap its reasoning (`<think>...`) at N output tokens; when the cap is reached and the
model has not closed its reasoning, the engine appends the end-of-thinking text's tokens itself and the answer
follows (what Anthropic's `thinking.budget_tokens` and the OpenAI servers' reasoning effort ask for).

The request's SamplingParams carry it (the frontend fills them: frontend/reasoning.budget_params):

    reasoning_budget  N >= 1: reasoning tokens allowed, counted from the output's first token (an opening tag the
                      model writes counts); None: no budget
    reasoning_end     the text forced when the budget runs out (e.g. "\\n</think>\\n\\n"); its stripped form is the end
                      tag whose appearance in the output ends the reasoning on its own
    reasoning_open    None: the output starts inside the reasoning (the prompt opened it); else the tag the output
                      must begin with (leading whitespace aside) for the reasoning to start; an output that begins
                      otherwise never reasons and the budget never applies

Forced tokens are output tokens like sampled ones, appended the way jump-forward appends a grammar's forced tokens
(scheduler/jump_forward.py): right after a sampled token, without KV, never streamed yet; the next step computes
them as one extend. Each goes through the output processor's stop, length and context checks; their logprob (when
asked for) is 0, the token itself being certain. A constrained request (a grammar) is not budgeted: its matcher
decides every token. Owner: ReasoningBudget (one per engine); per-request state: Req.reasoning (_BudgetState).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..kernels.forward_io import TokenLogprob
from .output import OutputProcessor
from .req import Req


@dataclass
class _BudgetState:
    end_ids: list[int]
    end_tag: str
    open_tag: str | None  # None once the reasoning has started (or from the start)
    scanned: int = 0  # chars of req.text searched for the end tag


class ReasoningBudget:
    def __init__(self, tokenizer: Any, outputs: OutputProcessor) -> None:
        self.tokenizer = tokenizer
        self.outputs = outputs
        self._ids: dict[str, list[int]] = {}  # reasoning_end text -> its tokens

    def attach(self, req: Req) -> None:
        """Give a new request its budget state (none without a budget, or with a grammar)."""
        p = req.params
        if p.reasoning_budget is None or req.grammar is not None:
            return
        ids = self._ids.get(p.reasoning_end)
        if ids is None:
            ids = self._ids[p.reasoning_end] = list(self.tokenizer.encode(p.reasoning_end, add_special_tokens=False))
        req.reasoning = _BudgetState(ids, p.reasoning_end.strip(), p.reasoning_open)

    def after_token(self, req: Req) -> None:
        """Called after each sampled token is appended: ends the budget when the reasoning closed (or never
        started), and appends the end tokens when the budget is spent."""
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
        if len(req.output_ids) < req.params.reasoning_budget:
            return
        req.reasoning = None
        want = req.params.logprobs
        for tok in state.end_ids:
            if req.finish_reason is not None:
                break
            logprob = TokenLogprob(tok, 0.0, [(tok, 0.0)][:want]) if want is not None else None
            self.outputs.append_token(req, tok, logprob)

    @staticmethod
    def _opened(req: Req, state: _BudgetState) -> bool:
        """Whether the output has opened its reasoning; drops the budget once it is clear it never will."""
        head = req.text.lstrip()
        if head.startswith(state.open_tag):
            state.open_tag = None
            return True
        if not state.open_tag.startswith(head):
            req.reasoning = None
        return False
