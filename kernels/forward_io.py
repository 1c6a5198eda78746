"""The hand-off between the scheduler and the model runner.

The scheduler describes a step as a list of ``SeqInput`` (plain Python ints and lists);
the runner turns them into tensors (``ForwardInput`` inside the runner), runs the model
over the paged KV pool, samples, and returns one ``SeqOutput`` per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeqInput:
    """One sequence's share of a forward step (a prefill chunk or one decode token)."""

    input_ids: list[int]  # tokens computed this step
    prefix_len: int  # tokens of this sequence already in the KV pool
    slot_ids: list[int]  # KV slot of every position 0 .. prefix_len + len(input_ids) - 1
    sample: bool  # sample a next token after the last input token
    sampling: Any = None  # SamplingParams-like object (duck-typed; see scheduler/sampling_params.py)
    sampling_seed: int = 0  # effective seed; token randomness = f(sampling_seed, len(output_ids))
    prompt_ids: list[int] = field(default_factory=list)  # for repetition penalty
    output_ids: list[int] = field(default_factory=list)  # for penalties and the seed position
    eos_ids: tuple[int, ...] = ()  # masked (with stop_token_ids) while min_new_tokens is unmet
    # Prompt logprobs: logprob of each input token at absolute position >= this, given the
    # tokens before it (needs the logits of the previous position). None = not requested.
    prompt_logprob_start: int | None = None
    num_top_logprobs: int = 0  # top-k alternatives returned with each logprob


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
    # scores the next chunk's first token from prompt_ids). Position 0 has no logprob.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
