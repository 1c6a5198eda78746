"""ModelRunner: owns the weights, the KV pool and the attention backend; runs one step.

How a step's ``SeqInput`` list is read (the contract with the scheduler):

- ``input_ids`` are computed at absolute positions ``prefix_len + j``. The runner owns the
  request->slot table (``slot_table``, ``[max_running_requests, context_length]`` int64, on the
  model's device): row ``row`` holds the KV slot of every position of that request. A step first
  writes ``new_slots`` at ``row[slot_offset:]`` (only what the row lacks or what changed), then
  the new K/V go to ``row[prefix_len : prefix_len + len(input_ids)]`` and the cached prefix is
  read from ``row[:prefix_len]``. So host work per step is O(batch + new tokens), never
  O(context): ``counters`` (``HostCounters``) records it.
- ``shared`` (optional, from the scheduler): key ranges that several sequences of the step
  hold in the same slots (radix nodes they all locked); attention reads each once
  (ARCHITECTURE §7).
- ``sample``: a next token is drawn from the logits of the last input token (see sampling.py;
  its randomness depends only on ``sampling_seed`` and ``sample_index``). Output logprobs
  are returned when ``sampling.logprobs`` is not None or ``num_top_logprobs > 0``.
- Prompt logprobs (``prompt_logprob_start`` not None): the logprob of the token at absolute
  position p needs the logits of position p - 1, so a chunk covers the targets

      p in [max(1, prompt_logprob_start, prefix_len + 1), end)
      end = prefix_len + len(input_ids) + 1   if lookahead_id is not None (the chunk ends inside the prompt)
            prefix_len + len(input_ids)       otherwise

  The look-ahead target (``lookahead_id``, the first token of the *next* chunk) means
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
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from . import native as native_lib
from . import quant_act
from .attention import ATTENTION_BACKENDS
from .attention.base import AttentionBackend, AttentionMetadata, SharedPrefix
from .attention.metadata import HostCounters, build_metadata, gather_rows, host_tensor
from .forward_io import SeqInput, SeqOutput, TokenLogprob
from .host_memory import retain_freed_memory
from .attention.kv_int8 import make_pool
from .kv_budget import (CUDA_KV_MEMORY_FRACTION, DEFAULT_CPU_KV_TOKENS, default_cpu_kv_tokens, kv_bytes_per_token,
                        kv_pool_slots)
from .gguf_file import is_gguf_path
from .gguf_loader import keeps_blocks, load_gguf_state_dict
from .loader import checkpoint_dtype, load_state_dict, resolve_dtype
from .quant import load_transform
from .quant_linear import kernel as quant_kernel
from .quant_spec import parse_quantization
from .model import CausalLM
from .model_config import ModelConfig, load_model_config
from .sampling import PenaltyState, sample_next_tokens, token_logprobs

logger = logging.getLogger(__name__)



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

    def __init__(self, model_path: str, *, num_slots: int | None, page_size: int = 1, dtype: str = "auto",
                 attention_backend: str = "auto", device: str | None = None,
                 context_length: int | None = None, max_running_requests: int = 64,
                 num_threads: int | None = None, retain_host_memory: bool = True,
                 native_kernels: bool = True, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", quantized_activations: str = "auto") -> None:
        for name, value in (("num_slots", 1 if num_slots is None else num_slots), ("max_running_requests", max_running_requests),
                            ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                             f"got {attention_backend!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        spec = parse_quantization(quantization)  # weights quantized tensor by tensor as read (kernels/quant.py)
        if spec is not None and self.device.type != "cpu":
            raise ValueError(f"quantization {quantization} runs on the CPU only (its kernels are CPU kernels), "
                             f"not on {self.device}")
        config = load_model_config(model_path)
        self.dtype = resolve_dtype(dtype, checkpoint_dtype(model_path, config), self.device)
        self.config: ModelConfig = replace(config, dtype=str(self.dtype).removeprefix("torch."))
        if kv_cache_dtype == "int8" and _make_backend_name(attention_backend, self.device) == "triton":
            raise ValueError("kv_cache_dtype int8 is read by the torch attention backend only (the native CPU kernel "
                             "or its torch fallback), not by triton: use kv_cache_dtype auto on CUDA")
        if num_slots is None:
            num_slots = default_kv_slots(config, self.dtype, self.device, kv_cache_dtype)
        self.num_slots = num_slots = kv_pool_slots(num_slots, page_size)
        self.context_length = min(config.max_position_embeddings, context_length or config.max_position_embeddings)
        if context_length and context_length > config.max_position_embeddings:
            logger.warning("context_length %d exceeds the model's max_position_embeddings %d; using %d",
                           context_length, config.max_position_embeddings, self.context_length)
        native = native_kernels and native_lib.supports(self.dtype, config.head_dim, self.device)
        self.native_sampling = native_kernels  # greedy argmax through the native library where it applies
        self.backend: AttentionBackend = _make_backend(attention_backend, self.device, native)
        gguf = is_gguf_path(model_path)
        # decode rows of the quantized linears in int8 (quant_act.py: auto for a GGUF file on the fp32 kernel)
        int8 = quant_act.resolve(quantized_activations, gguf, quant_kernel(self.dtype), self.device)
        if gguf:  # block tensors kept quantized where the quantized kernel runs
            state = load_gguf_state_dict(model_path, self.dtype, self.device, load_transform(spec),
                                         keeps_blocks(self.dtype, self.device), int8)
        else:
            state = load_state_dict(model_path, self.dtype, self.device, load_transform(spec))
        self.model = CausalLM(self.config, state, self.device, spec)
        quantized = self.model.quantized_weights()
        self.int8_activations = int8 and bool(quantized)  # GGUF blocks dequantized at load: nothing takes them
        for weight in quantized:
            weight.int8_activations = int8
        kv_shape = (config.num_layers, num_slots, config.num_kv_heads, config.head_dim)
        self.kv_cache_dtype = kv_cache_dtype  # auto: tensors in the model's dtype; int8: kv_int8.Int8KV pools
        self.k_cache, self.v_cache = make_pool(kv_shape, kv_cache_dtype, self.dtype, self.device)
        # The request->slot table; _row_len[r] = leading entries of row r that are valid.
        self.slot_table = torch.zeros((max_running_requests, self.context_length), dtype=torch.int64,
                                      device=self.device)
        self._row_len = [0] * max_running_requests
        if retain_host_memory and self.device.type == "cpu":  # after loading: its temporaries go back to the OS
            retain_freed_memory()  # each step's activations reuse freed heap, not fresh zeroed pages
        self.penalties = PenaltyState(num_rows=max_running_requests)  # per-row counts, kept incrementally
        self.counters = HostCounters()  # host work of the latest step
        self.last_profile: dict[str, float] = {}  # seconds of the latest step: build / forward / sample
        self.forward_input_hook: Callable[[ForwardInput], ForwardInput] | None = None
        self.attention = attention_path(self.backend.name, native)
        logger.info("model %s (%s) on %s, %s, %d KV slots (%s), attention=%s", model_path, config.architecture,
                    self.device, self.config.dtype, num_slots, kv_cache_dtype, self.attention)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], shared: Sequence[SharedPrefix] = ()) -> list[SeqOutput]:
        """One mixed step (prefill chunks + decodes): writes KV, samples, scores prompt tokens."""
        if not seqs:
            return []
        t0 = time.perf_counter()
        fi = self._prepare(seqs, shared)
        t1 = time.perf_counter()
        hidden = self._run_model(fi)
        logits = self.model.compute_logits(hidden[fi.logits_idx])  # [num_rows, vocab] float32
        t2 = time.perf_counter()
        outputs = self._sample(logits, fi, seqs)
        self.last_profile = {"build_s": t1 - t0, "forward_s": t2 - t1, "sample_s": time.perf_counter() - t2}
        return outputs

    def _sample(self, logits: torch.Tensor, fi: ForwardInput, seqs: list[SeqInput]) -> list[SeqOutput]:
        outputs = [SeqOutput(next_token_id=None, next_logprob=None) for _ in seqs]
        num_sampled = len(fi.sample_seq_idx)
        if num_sampled:
            tokens, logprobs = sample_next_tokens(logits[:num_sampled], [seqs[i] for i in fi.sample_seq_idx],
                                                 penalties=self.penalties, native=self.native_sampling)
            for i, token, lp in zip(fi.sample_seq_idx, tokens, logprobs):
                outputs[i].next_token_id = token
                outputs[i].next_logprob = lp
        for plan, scored in zip(fi.prompt_plans, self._score_prompts(logits, fi, seqs)):
            outputs[plan.seq_idx].prompt_logprobs = scored
        return outputs

    @torch.inference_mode()
    def forward_logits(self, seqs: list[SeqInput], shared: Sequence[SharedPrefix] = ()) -> list[torch.Tensor]:
        """Like ``forward`` (KV is written the same way) but returns, per sequence, the float32
        logits of every input position [len(input_ids), vocab], and samples nothing."""
        if not seqs:
            return []
        fi = self._prepare(seqs, shared)
        logits = self.model.compute_logits(self._run_model(fi))  # [num_tokens, vocab]
        return list(logits.split(fi.meta.q_lens_list))

    def build_forward_input(self, seqs: list[SeqInput], shared: Sequence[SharedPrefix] = ()) -> ForwardInput:
        """Turns the step's SeqInputs into tensors: table writes, ids, positions, attention
        metadata, logit rows. Per-token host data is only this step's new tokens and slots; it
        crosses to the device as one packed int64 tensor, then splits into views."""
        counters = self.counters = HostCounters()
        self._validate(seqs)
        chain = itertools.chain.from_iterable
        q_lens = [len(s.input_ids) for s in seqs]
        kv_lens = [s.prefix_len + q for s, q in zip(seqs, q_lens)]
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
        writes = [s for s in seqs if s.new_slots]
        parts = [
            list(chain(s.input_ids for s in seqs)),  # input_ids
            list(chain(range(s.prefix_len, s.prefix_len + len(s.input_ids)) for s in seqs)),  # positions
            rows,  # logits_idx
            list(chain([s.row] * len(s.new_slots) for s in writes)),  # table write rows
            list(chain(range(s.slot_offset, s.slot_offset + len(s.new_slots)) for s in writes)),  # columns
            list(chain(s.new_slots for s in writes)),  # slot ids
        ]
        counters.list_elems += sum(len(p) for p in parts)
        packed = host_tensor(list(chain(parts)), self.device, counters)
        input_ids, positions, logits_idx, w_rows, w_cols, w_slots = packed.split([len(p) for p in parts])
        self.slot_table[w_rows, w_cols] = w_slots
        seq_rows = [s.row for s in seqs]
        meta = build_metadata(q_lens=q_lens, kv_lens=kv_lens, rows=seq_rows, slot_table=self.slot_table,
                              out_slot_ids=torch.empty(0, dtype=torch.int64, device=self.device),
                              shared=list(shared), needs_kv_indices=self.backend.needs_kv_indices,
                              counters=counters)
        meta.out_slot_ids = gather_rows(self.slot_table, meta.rows, meta.kv_lens - meta.qo_indptr.diff(),
                                        meta.kv_lens, qo_indptr[-1])
        cfg = self.config
        self.backend.prepare(meta, cfg.num_heads // cfg.num_kv_heads, set(cfg.layer_sliding_windows))
        return ForwardInput(input_ids=input_ids, positions=positions, meta=meta, logits_idx=logits_idx,
                            sample_seq_idx=sample_seq_idx, prompt_plans=prompt_plans)

    # -----------------------------------------------------------------------------------------

    def _prepare(self, seqs: list[SeqInput], shared: Sequence[SharedPrefix]) -> ForwardInput:
        fi = self.build_forward_input(seqs, shared)
        if self.forward_input_hook is not None:
            fi = self.forward_input_hook(fi)
        return fi

    def _run_model(self, fi: ForwardInput) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model.forward(fi.input_ids, fi.positions, fi.meta, self.k_cache, self.v_cache, self.backend)

    def _validate(self, seqs: list[SeqInput]) -> None:
        """Checks a step against the table; updates each row's valid length (O(batch + new slots))."""
        seen_rows: set[int] = set()
        for i, seq in enumerate(seqs):
            q_len, row = len(seq.input_ids), seq.row
            if q_len == 0:
                raise ValueError(f"seq {i}: input_ids is empty")
            if seq.prefix_len < 0:
                raise ValueError(f"seq {i}: prefix_len must be >= 0, got {seq.prefix_len}")
            if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self._row_len):
                raise ValueError(f"seq {i}: row must be in [0, {len(self._row_len)}), got {row!r}")
            if row in seen_rows:
                raise ValueError(f"seq {i}: row {row} appears twice in one step")
            seen_rows.add(row)
            if seq.prefix_len + q_len > self.context_length:
                raise ValueError(f"seq {i}: {seq.prefix_len + q_len} tokens exceed the context length "
                                 f"{self.context_length}")
            known = 0 if seq.new_row else self._row_len[row]
            if seq.new_slots and not 0 <= seq.slot_offset <= known:
                raise ValueError(f"seq {i}: slot_offset {seq.slot_offset} would leave a gap in row {row} "
                                 f"(it holds {known} slots)")
            end = seq.slot_offset + len(seq.new_slots) if seq.new_slots else known
            if end > self.context_length:
                raise ValueError(f"seq {i}: slots past the context length {self.context_length}")
            if end < seq.prefix_len + q_len:
                raise ValueError(f"seq {i}: row {row} holds {end} slots but the step needs "
                                 f"prefix_len + len(input_ids) = {seq.prefix_len + q_len}")
            if seq.new_slots and (min(seq.new_slots) < 0 or max(seq.new_slots) >= self.num_slots):
                raise ValueError(f"seq {i}: slot ids must be in [0, {self.num_slots})")
        for seq in seqs:
            if seq.new_slots or seq.new_row:
                self._row_len[seq.row] = seq.slot_offset + len(seq.new_slots) if seq.new_slots else 0

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


def default_kv_slots(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                     kv_cache_dtype: str = "auto") -> int:
    """KV pool size when none is given: on the CPU the memory of DEFAULT_CPU_KV_TOKENS in the model's dtype; on
    CUDA a fraction of the free memory (measured before the weights load); either divided by one slot's real
    bytes in the pool's dtype (kv_budget.kv_bytes_per_token)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    shape = (config.num_layers, config.num_kv_heads, config.head_dim, element_size)
    bytes_per_slot = kv_bytes_per_token(*shape, kv_cache_dtype)
    if device.type != "cuda":
        return default_cpu_kv_tokens(bytes_per_slot, kv_bytes_per_token(*shape))
    free_bytes, _ = torch.cuda.mem_get_info(device)
    return max(DEFAULT_CPU_KV_TOKENS, int(free_bytes * CUDA_KV_MEMORY_FRACTION // bytes_per_slot))


def attention_path(backend: str, native: bool) -> str:
    """What reads the KV pool, as the start-up lines name it: the torch backend reads through the native
    kernel ("native avx512", its build) where native.supports() held, else through torch's flash op."""
    if backend != "torch":
        return backend
    return native_lib.status() if native else "torch flash op"


def _make_backend_name(name: str, device: torch.device) -> str:
    return ("triton" if device.type == "cuda" else "torch") if name == "auto" else name


def _make_backend(name: str, device: torch.device, native: bool) -> AttentionBackend:
    name = _make_backend_name(name, device)
    if name == "torch":
        from .attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(native=native)
    try:
        from .attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        raise ValueError(f"attention_backend='triton' is unavailable ({exc}); install triton or use "
                         "attention_backend='torch'") from exc
    return TritonAttentionBackend()


def _prompt_targets(seq: SeqInput) -> tuple[int, list[int]]:
    """(first target position, target token ids) of the prompt logprobs this chunk covers."""
    if seq.prompt_logprob_start is None:
        return 0, []
    computed_end = seq.prefix_len + len(seq.input_ids)
    end = computed_end + 1 if seq.lookahead_id is not None else computed_end
    first = max(1, seq.prompt_logprob_start, seq.prefix_len + 1)
    targets = [seq.input_ids[p - seq.prefix_len] for p in range(first, min(end, computed_end))]
    if end > computed_end and first <= computed_end:
        targets.append(seq.lookahead_id)
    return first, targets


