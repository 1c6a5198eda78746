"""Constrained decoding in the step: per-request grammar matchers, the step's token bitmask,
and the one place a matcher moves (with jump-forward). Used by the Engine; xgrammar itself
stays behind scheduler/grammar.py (imported lazily, engine process only)."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from ..kernels.forward_io import SeqInput
from .grammar import GrammarBackend
from .jump_forward import CONTEXT_IDS, jump_forward_ids
from .metrics import EngineMetrics
from .output import OutputProcessor
from .reasoning_budget import grammar_active
from .req import Req
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ConstrainedDecoding:
    def __init__(self, grammar: GrammarBackend, tokenizer: Any, outputs: OutputProcessor, metrics: EngineMetrics,
                 eos_token_ids: Sequence[int], max_rows: int, context_length: int, disable_jump_forward: bool) -> None:
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.outputs = outputs
        self.metrics = metrics
        self.max_rows = max_rows
        self.context_length = context_length
        self.disable_jump_forward = disable_jump_forward
        self._special_ids = frozenset(tokenizer.special_token_ids) | frozenset(eos_token_ids)
        self._bitmask: Any = None  # [max_rows, ceil(vocab / 32)] int32, on first use

    def attach(self, req: Req, compiled: Any, params: SamplingParams) -> None:
        """Give a new request its matcher (and the extra ban its grammar kind needs)."""
        req.grammar = self.grammar.matcher(compiled)
        req.grammar_ban = self.grammar.extra_ban(params)

    def fill_masks(self, items: Sequence[Any], seqs: Sequence[SeqInput]) -> None:
        """Each constrained request sampled this step gets its row of the step's token bitmask
        (bit set = allowed); the sampler sends ~-inf to the rest. Prefill chunks that sample
        nothing need none. `items` are the batch's planner.BatchItems (req, sample)."""
        num = 0
        for item, seq in zip(items, seqs):
            req = item.req
            if not grammar_active(req) or not item.sample:  # none, or held while the output reasons
                continue
            if self._bitmask is None:
                self._bitmask = self.grammar.allocate_bitmask(self.max_rows)
            req.grammar.fill_next_token_bitmask(self._bitmask, num)
            if req.grammar_ban is not None:
                self._bitmask[num] &= req.grammar_ban
            seq.token_bitmask = self._bitmask[num]  # [ceil(vocab / 32)] int32 view
            num += 1

    def append(self, req: Req, token_id: int, logprob: Any) -> None:
        """The one place a constrained request's matcher moves: it accepts each sampled token before the
        output processor appends it, so that a forced continuation (jump-forward, scheduler/jump_forward.py)
        can be appended with it, or replace it, while that token has no KV and was never streamed; the
        next step computes the forced tokens as one extend. A grammar that is complete (its stop token
        accepted, also under ignore_eos) ends the request."""
        matcher = req.grammar
        accepted = matcher.accept_token(token_id)
        ids = [token_id]
        if accepted and not matcher.is_terminated() and self._may_jump(req):
            room = min(req.params.max_new_tokens - len(req.output_ids), self.context_length - req.seq_len)
            jump = jump_forward_ids(matcher, self.tokenizer, _tail_ids(req, CONTEXT_IDS), token_id, room,
                                    self._special_ids)
            if jump is not None:
                ids, replaced = jump
                m = self.metrics
                m.num_jump_forward_steps += 1
                m.num_jump_forward_tokens += len(ids) - 1
                m.num_jump_forward_retokenized += int(replaced)
        self.outputs.append_token(req, ids[0], logprob if ids[0] == token_id else None)
        for tok in ids[1:]:  # forced: each checked for stops, max_new_tokens and the context as sampled ones
            if req.finish_reason is not None:
                break
            self.outputs.append_token(req, tok, None)
        if req.finish_reason is not None:
            return
        if not accepted:  # the mask allowed it, so this is a bug
            logger.error("request %s: token %d rejected by its grammar", req.rid, token_id)
            self.outputs.finish(req, "abort", error=f"token {token_id} was rejected by the request's grammar")
        elif matcher.is_terminated():
            self.outputs.finish(req, "stop")

    def _may_jump(self, req: Req) -> bool:
        # Forced tokens are never sampled, so they have no logprobs: requests that ask for any decode on.
        p = req.params
        return not self.disable_jump_forward and p.logprobs is None and p.logprob_start_len is None


def _tail_ids(req: Req, num: int) -> list[int]:
    """The last num ids of the sequence, without concatenating prompt and output."""
    if len(req.output_ids) >= num:
        return req.output_ids[-num:]
    return req.prompt_ids[len(req.output_ids) - num:] + req.output_ids
