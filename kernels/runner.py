"""ModelRunner: owns the weights, the KV pool and the attention backend; runs one step.

How a step's ``SeqInput`` list is read (the contract with the scheduler):

- ``input_ids`` are computed at absolute positions ``prefix_len + j``; ``slot_ids`` lists the KV
  slot of every position ``0 .. prefix_len + len(input_ids) - 1``; the new K/V go to
  ``slot_ids[prefix_len:]``, the cached prefix is read from ``slot_ids[:prefix_len]``.
- ``sample``: a next token is drawn from the logits of the last input token (see sampling.py;
  its randomness depends only on ``sampling_seed`` and ``len(output_ids)``). Output logprobs
  are returned when ``sampling.logprobs`` is not None or ``num_top_logprobs > 0``.
- Prompt logprobs (``prompt_logprob_start`` not None): the logprob of the token at absolute
  position p needs the logits of position p - 1, so a chunk covers the targets

      p in [max(1, prompt_logprob_start, prefix_len + 1), end)
      end = prefix_len + len(input_ids) + 1   if prefix_len + len(input_ids) < len(prompt_ids)
            prefix_len + len(input_ids)       otherwise

  The look-ahead target (the first token of the *next* chunk, read from ``prompt_ids``) means
  that consecutive chunks with the same ``prompt_logprob_start`` cover the prompt without a
  gap at chunk boundaries. What no chunk can cover is position ``prefix_len`` of the first
  computed chunk when that prefix came from the cache: its logits were never computed. So the
  scheduler caps the cached prefix at ``max(0, logprob_start_len - 1)`` tokens.
  ``SeqOutput.prompt_logprobs`` holds the covered targets in position order.

Test hook: ``forward_input_hook`` (None in production) may replace the ``ForwardInput`` of a
step just before the model runs; mutation tests use it to corrupt positions or cached KV.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from radixserve.kernels.attention.base import AttentionBackend, AttentionMetadata
from radixserve.kernels.forward_io import SeqInput, SeqOutput, TokenLogprob
from radixserve.kernels.loader import checkpoint_dtype, load_state_dict, resolve_dtype
from radixserve.kernels.model import CausalLM
from radixserve.kernels.model_config import ModelConfig, load_model_config
from radixserve.kernels.sampling import sample_next_tokens, token_logprobs

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class PromptLogprobPlan:
    seq_idx: int
    first_row: int  # row of the logits block (after the sampled rows)
    target_ids: list[int]  # tokens scored, one per row, in position order


@dataclass
class ForwardInput:
    """Every tensor of one step, built in one place (``ModelRunner.build_forward_input``)."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute
    meta: AttentionMetadata
    logits_idx: torch.Tensor  # [num_rows] int64 token rows whose logits are computed
    sample_seq_idx: list[int]  # seqs sampled; logits rows 0 .. len - 1 in this order
    prompt_plans: list[PromptLogprobPlan]  # prompt-logprob rows follow the sampled rows


class ModelRunner:
    """Loads a checkpoint and runs mixed prefill/decode steps over a paged KV pool."""

    def __init__(self, model_path: str, *, num_slots: int, dtype: str = "auto",
                 attention_backend: str = "auto", device: str | None = None,
                 context_length: int | None = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {attention_backend!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        config = load_model_config(model_path)
        self.dtype = resolve_dtype(dtype, checkpoint_dtype(model_path, config), self.device)
        self.config: ModelConfig = replace(config, dtype=str(self.dtype).removeprefix("torch."))
        self.num_slots = num_slots
        self.context_length = min(config.max_position_embeddings, context_length or config.max_position_embeddings)
        if context_length and context_length > config.max_position_embeddings:
            logger.warning("context_length %d exceeds the model's max_position_embeddings %d; using %d",
                           context_length, config.max_position_embeddings, self.context_length)
        self.backend: AttentionBackend = _make_backend(attention_backend, self.device)
        self.model = CausalLM(self.config, load_state_dict(model_path, self.dtype, self.device), self.device)
        kv_shape = (config.num_layers, num_slots, config.num_kv_heads, config.head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(kv_shape, dtype=self.dtype, device=self.device)
        self.forward_input_hook: Callable[[ForwardInput], ForwardInput] | None = None
        logger.info("model %s (%s) on %s, %s, %d KV slots, attention=%s", model_path, config.architecture,
                    self.device, self.config.dtype, num_slots, self.backend.name)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> list[SeqOutput]:
        """One mixed step (prefill chunks + decodes): writes KV, samples, scores prompt tokens."""
        if not seqs:
            return []
        fi = self._prepare(seqs)
        hidden = self._run_model(fi)
        logits = self.model.compute_logits(hidden[fi.logits_idx])  # [num_rows, vocab] float32
        outputs = [SeqOutput(next_token_id=None, next_logprob=None) for _ in seqs]
        num_sampled = len(fi.sample_seq_idx)
        if num_sampled:
            tokens, logprobs = sample_next_tokens(logits[:num_sampled], [seqs[i] for i in fi.sample_seq_idx])
            for i, token, lp in zip(fi.sample_seq_idx, tokens, logprobs):
                outputs[i].next_token_id = token
                outputs[i].next_logprob = lp
        for plan, scored in zip(fi.prompt_plans, self._score_prompts(logits, fi, seqs)):
            outputs[plan.seq_idx].prompt_logprobs = scored
        return outputs

    @torch.inference_mode()
    def forward_logits(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """Like ``forward`` (KV is written the same way) but returns, per sequence, the float32
        logits of every input position [len(input_ids), vocab], and samples nothing."""
        if not seqs:
            return []
        fi = self._prepare(seqs)
        logits = self.model.compute_logits(self._run_model(fi))  # [num_tokens, vocab]
        return list(logits.split(fi.meta.q_lens_list))

    def build_forward_input(self, seqs: list[SeqInput]) -> ForwardInput:
        """Turns the step's SeqInputs into tensors: ids, positions, attention metadata, logit rows.

        Everything is gathered into Python lists first and crosses to the device as one packed
        int64 tensor (one host-to-device copy per step), then split into views.
        """
        _validate(seqs, self.num_slots, self.context_length)
        chain = itertools.chain.from_iterable
        q_lens = [len(s.input_ids) for s in seqs]
        prefix_lens = [s.prefix_len for s in seqs]
        kv_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
        qo_indptr = list(itertools.accumulate(q_lens, initial=0))
        sample_seq_idx = [i for i, s in enumerate(seqs) if s.sample]
        rows = [qo_indptr[i + 1] - 1 for i in sample_seq_idx]
        prompt_plans = []
        for i, seq in enumerate(seqs):
            first_pos, target_ids = _prompt_targets(seq)
            if target_ids:
                prompt_plans.append(PromptLogprobPlan(i, len(rows), target_ids))
                first_row = qo_indptr[i] + first_pos - 1 - seq.prefix_len
                rows.extend(range(first_row, first_row + len(target_ids)))
        parts = [
            list(chain(s.input_ids for s in seqs)),  # input_ids
            list(chain(range(s.prefix_len, s.prefix_len + len(s.input_ids)) for s in seqs)),  # positions
            list(chain(s.slot_ids for s in seqs)),  # kv_indices
            list(chain(s.slot_ids[s.prefix_len:] for s in seqs)),  # out_slot_ids
            rows,  # logits_idx
            qo_indptr,
            list(itertools.accumulate(kv_lens, initial=0)),  # kv_indptr
            prefix_lens,
            kv_lens,
        ]
        packed = torch.tensor(list(chain(parts)), dtype=torch.int64).to(self.device)
        (input_ids, positions, kv_indices, out_slots, logits_idx, qo_t, kv_t, prefix_t, kv_lens_t) = \
            packed.split([len(part) for part in parts])
        meta = AttentionMetadata(
            qo_indptr=qo_t.int(), kv_indptr=kv_t.int(), kv_indices=kv_indices, prefix_lens=prefix_t.int(),
            kv_lens=kv_lens_t.int(), out_slot_ids=out_slots, max_q_len=max(q_lens), max_kv_len=max(kv_lens),
            q_lens_list=q_lens, kv_lens_list=kv_lens)
        return ForwardInput(input_ids=input_ids, positions=positions, meta=meta, logits_idx=logits_idx,
                            sample_seq_idx=sample_seq_idx, prompt_plans=prompt_plans)

    # -----------------------------------------------------------------------------------------

    def _prepare(self, seqs: list[SeqInput]) -> ForwardInput:
        fi = self.build_forward_input(seqs)
        if self.forward_input_hook is not None:
            fi = self.forward_input_hook(fi)
        return fi

    def _run_model(self, fi: ForwardInput) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model.forward(fi.input_ids, fi.positions, fi.meta, self.k_cache, self.v_cache, self.backend)

    def _score_prompts(self, logits: torch.Tensor, fi: ForwardInput,
                       seqs: list[SeqInput]) -> list[list[TokenLogprob]]:
        if not fi.prompt_plans:
            return []
        targets = [t for plan in fi.prompt_plans for t in plan.target_ids]
        num_tops = [seqs[plan.seq_idx].num_top_logprobs for plan in fi.prompt_plans for _ in plan.target_ids]
        start = fi.prompt_plans[0].first_row
        scored = token_logprobs(logits[start:start + len(targets)], targets, num_tops)
        out, pos = [], 0
        for plan in fi.prompt_plans:
            out.append(scored[pos:pos + len(plan.target_ids)])
            pos += len(plan.target_ids)
        return out


def _make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from radixserve.kernels.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend()
    try:
        from radixserve.kernels.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        raise ValueError(f"attention_backend='triton' is unavailable ({exc}); install triton or use "
                         "attention_backend='torch'") from exc
    return TritonAttentionBackend()


def _prompt_targets(seq: SeqInput) -> tuple[int, list[int]]:
    """(first target position, target token ids) of the prompt logprobs this chunk covers."""
    if seq.prompt_logprob_start is None:
        return 0, []
    computed_end = seq.prefix_len + len(seq.input_ids)
    end = computed_end + 1 if computed_end < len(seq.prompt_ids) else computed_end
    first = max(1, seq.prompt_logprob_start, seq.prefix_len + 1)
    targets = [seq.input_ids[p - seq.prefix_len] for p in range(first, min(end, computed_end))]
    if end > computed_end and first <= computed_end:
        targets.append(seq.prompt_ids[computed_end])
    return first, targets


def _validate(seqs: list[SeqInput], num_slots: int, context_length: int) -> None:
    for i, seq in enumerate(seqs):
        q_len = len(seq.input_ids)
        if q_len == 0:
            raise ValueError(f"seq {i}: input_ids is empty")
        if len(seq.slot_ids) != seq.prefix_len + q_len:
            raise ValueError(f"seq {i}: len(slot_ids)={len(seq.slot_ids)} must equal prefix_len + "
                             f"len(input_ids) = {seq.prefix_len} + {q_len}")
        if seq.prefix_len + q_len > context_length:
            raise ValueError(f"seq {i}: {seq.prefix_len + q_len} tokens exceed the context length "
                             f"{context_length}")
        if seq.prefix_len < 0:
            raise ValueError(f"seq {i}: prefix_len must be >= 0, got {seq.prefix_len}")
    lo = min(min(s.slot_ids) for s in seqs)
    hi = max(max(s.slot_ids) for s in seqs)
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"slot ids must be in [0, {num_slots}), got range [{lo}, {hi}]")
