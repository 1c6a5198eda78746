"""What a step sends the runner for one request (kernels/forward_io.SeqInput): its new tokens, only the slots its
table row lacks, and what the sampler reads — never the request's token lists themselves."""
from __future__ import annotations

from ..kernels.forward_io import SeqInput
from .req import Req


def seq_input(req: Req, num_tokens: int, sample: bool, context_length: int,
              eos_ids: tuple[int, ...]) -> SeqInput:
    """The step's share of `req`: positions [kv_len, kv_len + num_tokens), sampling after them if `sample`."""
    start, end = req.kv_len, req.kv_len + num_tokens
    p = req.params
    offset, new_slots, new_row = req.slot_row.take_unsynced(context_length)  # the tail past the context: never read
    return SeqInput(
        input_ids=token_slice(req, start, end), prefix_len=start, row=req.row, new_slots=new_slots,
        slot_offset=offset, new_row=new_row,
        sample=sample, sampling=req.sampling, sampling_seed=req.seed, sample_index=len(req.output_ids),
        penalty_tokens=(req.slot_row.take_penalty_tokens(req.prompt_ids, req.output_ids)
                        if sample and req.sampling.penalised else None),
        banned_ids=req.banned_ids(eos_ids) if sample else (),
        prompt_logprob_start=p.logprob_start_len,
        lookahead_id=req.prompt_ids[end] if p.logprob_start_len is not None and end < len(req.prompt_ids) else None,
        num_top_logprobs=p.logprobs or 0)


def token_slice(req: Req, start: int, end: int) -> list[int]:
    """all_ids[start:end] without concatenating the prompt and the outputs."""
    num_prompt = len(req.prompt_ids)
    if start >= num_prompt:
        return req.output_ids[start - num_prompt:end - num_prompt]
    if end <= num_prompt:
        return req.prompt_ids[start:end]
    return req.prompt_ids[start:] + req.output_ids[:end - num_prompt]
