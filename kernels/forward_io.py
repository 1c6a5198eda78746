"""The hand-off between the scheduler and the model runner.

The scheduler describes a step as a list of ``SeqInput`` (plain Python ints and lists);
the runner turns them into tensors (``ForwardInput`` inside the runner), runs the model
over the paged KV pool, samples, and returns one ``SeqOutput`` per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class RowSampling:
    """A request's sampling settings as the sampler reads them: built once per request by the scheduler
    (`SamplingParams.row_sampling`), so a renamed setting is an error, never a silent default."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None  # token id -> bias added to its logit
    logprobs: bool = False  # return the sampled token's logprob

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the sampler reads the request's tokens (a repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


GREEDY = RowSampling()


@dataclass(frozen=True)
class PenaltyTokens:
    """What a sampled row's penalty statistics take in this step (kernels/sampling_penalties.PenaltyState).

    reset: the row starts afresh from `prompt` + `output` (the whole context: its first feed on this row);
    otherwise `prompt` is empty and `output` holds the output tokens generated since the previous feed."""

    reset: bool
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()


@dataclass
class SeqInput:
    """One sequence's share of a forward step (a prefill chunk or one decode token)."""

    input_ids: list[int]  # tokens computed this step
    prefix_len: int  # tokens of this sequence already in the KV pool
    row: int  # this request's row of the runner's request->slot table (unique among running requests)
    # Table writes before the step: row[slot_offset : slot_offset + len(new_slots)] = new_slots.
    # After them the row must hold the slot of every position 0 .. prefix_len + len(input_ids) - 1;
    # a step sends only slots the row does not hold yet (or that changed), never the whole list.
    new_slots: list[int]
    slot_offset: int
    sample: bool  # sample a next token after the last input token
    new_row: bool = False  # first step of this request on this row (per-row state starts afresh)
    sampling: RowSampling = GREEDY
    sampling_seed: int = 0  # effective seed; token randomness = f(sampling_seed, sample_index)
    sample_index: int = 0  # output tokens the request has before this step (the noise's position)
    # The request's penalty statistics on its row (sampled rows with a penalty only), kept by the scheduler.
    penalty_tokens: PenaltyTokens | None = None
    banned_ids: tuple[int, ...] = ()  # never sampled this step (the scheduler's stop rules: EOS before min_new_tokens)
    # Prompt logprobs: logprob of each input token at absolute position >= this, given the
    # tokens before it (needs the logits of the previous position). None = not requested.
    prompt_logprob_start: int | None = None
    # With prompt logprobs and a chunk that ends inside the prompt: the prompt token right after it (scored from
    # this chunk's last logits, so consecutive chunks leave no gap). None otherwise.
    lookahead_id: int | None = None
    num_top_logprobs: int = 0  # top-k alternatives returned with each logprob
    # Structured generation: [ceil(vocab / 32)] int32 tensor, bit j of word w set = token 32 * w + j
    # allowed (xgrammar's layout); tokens past its width are disallowed. None = unconstrained.
    token_bitmask: Any = None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [(token_id, logprob)] best first, len = num_top_logprobs


@dataclass
class SeqOutput:
    next_token_id: int | None  # None when sample is False
    next_logprob: TokenLogprob | None  # set when sampled and logprobs were requested
    # Logprobs of prompt tokens at positions p in [max(1, prompt_logprob_start, prefix_len + 1), end),
    # in order, where end is the chunk's end, plus one while the prompt continues (the runner
    # scores the next chunk's first token from lookahead_id). Position 0 has no logprob.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
