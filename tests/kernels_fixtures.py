"""Test helpers for tests/test_kernels_*.py: tiny seeded HF checkpoints and a mini scheduler.

The mini scheduler drives ``ModelRunner`` the way the real one will: chunked prefills, a
later request reusing the KV slots of an earlier request's prefix, decodes batched with
prefill chunks, and slot ids drawn from shuffled pages (non-contiguous).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from transformers import GenerationConfig

from radixserve.kernels import ForwardInput, ModelRunner, SeqInput
from radixserve.kernels.forward_io import PenaltyTokens
from radixserve.kernels.attention.base import SharedPrefix
from radixserve.kernels.attention.metadata import gather_rows
from radixserve.scheduler.sampling_params import SamplingParams

@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine spin-wait
    on each other (a 20-40x slowdown measured). Restores the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)
CONFIG_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def make_checkpoint(path: str, kind: str, seed: int = 0, max_shard_size: str | None = None,
                    dtype: torch.dtype = torch.float32, **overrides) -> str:
    """Saves a seeded random checkpoint of `kind` (llama/mistral/qwen2/qwen3) under `path`, stored in `dtype`."""
    config_cls, model_cls = CONFIG_CLASSES[kind]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _perturb_norms_and_biases(model)
    model.to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, 3])
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return str(path)


def _perturb_norms_and_biases(model) -> None:
    # HF initialises norms to 1 and biases to 0, which would hide a missing or misplaced one.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)


def load_hf(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] float32
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def make_prompts(num: int, shared_len: int, tail_lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that share one prefix of `shared_len` tokens, then differ (ids avoid 0..3)."""
    rng = random.Random(seed)
    shared = [rng.randrange(4, vocab) for _ in range(shared_len)]
    return [shared + [rng.randrange(4, vocab) for _ in range(tail_lens[i % len(tail_lens)])]
            for i in range(num)]


class PagedSlots:
    """Hands out slots page by page from a shuffled page list, so slot ids are scattered."""

    def __init__(self, num_slots: int, page_size: int = 4, seed: int = 0) -> None:
        pages = list(range(num_slots // page_size))
        random.Random(seed).shuffle(pages)
        self.page_size = page_size
        self.pages = pages

    def alloc(self, num_tokens: int) -> list[int]:
        num_pages = -(-num_tokens // self.page_size)
        taken, self.pages = self.pages[:num_pages], self.pages[num_pages:]
        return [p * self.page_size + j for p in taken for j in range(self.page_size)][:num_tokens]


@dataclass
class _Req:
    tokens: list[int]  # known tokens: prompt (+ forced continuation in teacher-forced mode)
    prompt_len: int
    start_step: int
    share_from: int | None = None
    share_len: int = 0
    slots: list[int] = field(default_factory=list)
    synced: int = 0  # leading slots already written to the runner's table row
    computed: int = 0
    output: list[int] = field(default_factory=list)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits


@dataclass
class DriveStats:
    num_steps: int = 0
    mixed_steps: int = 0  # steps with a prefill chunk and a decode together
    reused_tokens: int = 0  # prefix tokens read from another request's slots
    shared_steps: int = 0  # steps that passed shared prefixes to the runner


def drive(runner: ModelRunner, sequences: list[list[int]], prompt_lens: list[int], num_new: int, *,
          forced: bool, chunk: int = 7, share: dict[int, tuple[int, int]] | None = None,
          sampling: list[SamplingParams] | None = None, seeds: list[int] | None = None,
          slot_seed: int = 0, cascade: bool = False) -> tuple[list[_Req], DriveStats]:
    """Runs requests through the runner step by step.

    forced=False: generate `num_new` tokens per request with `runner.forward` (sampling).
    forced=True: feed `sequences` in full (prompt chunks, then one token per step) through
    `runner.forward_logits` and record the logits of every computed position.
    share: {req: (earlier_req, num_tokens)}: the request starts from that many prefix slots
    of the earlier request (which must have computed them by then).
    cascade: pass those shared slots to the runner as shared prefixes (cascade attention)
    whenever the donor and its sharers are in one step.
    """
    share = share or {}
    pool = PagedSlots(runner.num_slots, seed=slot_seed)
    reqs = [_Req(tokens=list(s), prompt_len=p, start_step=2 * i, share_from=share.get(i, (None, 0))[0],
                 share_len=share.get(i, (None, 0))[1]) for i, (s, p) in enumerate(zip(sequences, prompt_lens))]
    stats = DriveStats()
    step = 0
    while any(not _done(r, num_new, forced) for r in reqs):
        batch, owners = [], []
        for idx, req in enumerate(reqs):
            if req.start_step > step or _done(req, num_new, forced):
                continue
            if not req.slots and not _admit(req, reqs, pool, stats):
                continue
            batch.append(_seq_input(req, idx, chunk, forced, sampling, seeds, runner.context_length))
            owners.append(req)
        step += 1
        if not batch:
            continue
        stats.num_steps += 1
        lens = [len(s.input_ids) for s in batch]
        stats.mixed_steps += int(any(n == 1 and s.prefix_len >= r.prompt_len for n, s, r in zip(lens, batch, owners))
                                 and any(s.prefix_len < r.prompt_len for s, r in zip(batch, owners)))
        shared = _shared_prefixes(reqs, owners, batch) if cascade else []
        stats.shared_steps += int(bool(shared))
        if forced:
            for req, seq, logits in zip(owners, batch, runner.forward_logits(batch, shared)):
                for j in range(len(seq.input_ids)):
                    req.logits[seq.prefix_len + j] = logits[j]
                req.computed += len(seq.input_ids)
        else:
            for req, seq, out in zip(owners, batch, runner.forward(batch, shared)):
                req.computed += len(seq.input_ids)
                if out.next_token_id is not None:
                    req.output.append(out.next_token_id)
                    req.tokens.append(out.next_token_id)
    return reqs, stats


def _done(req: _Req, num_new: int, forced: bool) -> bool:
    return req.computed >= len(req.tokens) if forced else len(req.output) >= num_new


def _admit(req: _Req, reqs: list[_Req], pool: PagedSlots, stats: DriveStats) -> bool:
    total = len(req.tokens) + 64  # room for generated tokens
    if req.share_from is None:
        req.slots = pool.alloc(total)
        return True
    donor = reqs[req.share_from]
    if donor.computed < req.share_len:
        return False
    assert donor.tokens[:req.share_len] == req.tokens[:req.share_len]
    req.slots = donor.slots[:req.share_len] + pool.alloc(total - req.share_len)
    req.computed = req.share_len
    stats.reused_tokens += req.share_len
    return True


def _shared_prefixes(reqs: list[_Req], owners: list[_Req], batch: list[SeqInput]) -> list[SharedPrefix]:
    """Per donor in the step, the largest set of its sharers (same share_len) also in the step."""
    pos = {id(r): i for i, r in enumerate(owners)}
    groups: dict[tuple[int, int], list[int]] = {}
    for i, req in enumerate(owners):
        donor = reqs[req.share_from] if req.share_from is not None else None
        if donor is None or id(donor) not in pos:
            continue
        j = pos[id(donor)]
        if min(batch[i].prefix_len, batch[j].prefix_len) >= req.share_len:
            groups.setdefault((j, req.share_len), []).append(i)
    best: dict[int, tuple[int, list[int]]] = {}
    for (j, length), members in groups.items():
        if j not in best or len(members) > len(best[j][1]):
            best[j] = (length, members)
    return [SharedPrefix(0, length, sorted([j, *members])) for j, (length, members) in best.items()]


def _seq_input(req: _Req, idx: int, chunk: int, forced: bool, sampling, seeds, context_length: int) -> SeqInput:
    if req.computed < req.prompt_len:
        end = min(req.prompt_len, req.computed + chunk)
    else:
        end = req.computed + 1
    params = (sampling[idx] if sampling else SamplingParams(temperature=0.0)).row_sampling()
    hi = min(len(req.slots), context_length)
    new_slots, offset, req.synced = req.slots[req.synced:hi], req.synced, hi
    # Penalised rows get their whole context every step (a reset feed: the same statistics as incremental ones).
    feed = PenaltyTokens(True, tuple(req.tokens[:req.prompt_len]), tuple(req.output)) if params.penalised else None
    return SeqInput(
        input_ids=req.tokens[req.computed:end], prefix_len=req.computed, row=idx, new_slots=new_slots,
        slot_offset=offset, new_row=offset == 0 and bool(new_slots),
        sample=not forced and end >= len(req.tokens), sampling=params,
        sampling_seed=seeds[idx] if seeds else 0, sample_index=len(req.output), penalty_tokens=feed)


# -- mutations for the parity checks (installed as runner.forward_input_hook) ----------------

def restart_positions(fi: ForwardInput) -> ForwardInput:
    # Positions counted from 0 again after the cached prefix (the classic chunking bug).
    prefix_lens = fi.meta.kv_lens.long() - fi.meta.qo_indptr.diff().long()
    prefix = torch.repeat_interleave(prefix_lens, torch.tensor(fi.meta.q_lens_list))
    fi.positions = fi.positions - prefix
    return fi


def zero_cached_kv(runner: ModelRunner):
    def hook(fi: ForwardInput) -> ForwardInput:
        m = fi.meta
        written = set(m.out_slot_ids.tolist())
        every = gather_rows(m.slot_table, m.rows, torch.zeros_like(m.rows), m.kv_lens, sum(m.kv_lens_list))
        cached = [s for s in every.tolist() if s not in written]
        runner.k_cache[:, cached] = 0
        runner.v_cache[:, cached] = 0
        return fi
    return hook
