"""bf16 parity with transformers' fp32 forward (issue 35 item 9), teacher-forced over random prompts.

fp32 parity is exact (test_kernels_parity.py). In bf16 the top-1 token can flip wherever the fp32 top two are
near a tie, and random weights make near-ties common, so agreement is checked where it is well defined:
(a) on the positions where the fp32 top-1 logit leads the second by more than GAP, the engine's bf16 top-1 agrees
on >= 99.5% (at least MIN_DECISIVE such positions, at least MIN_SHARE of all); (b) over all positions, its
agreement is at most one point below transformers' own bf16 forward's on the same checkpoint and prompts.

The engine side is ModelRunner's bf16 path as the scheduler drives it: chunked prefills, later prompts reading
an earlier prompt's KV from the pool, shared prefixes read once (kernels_fixtures.drive, cascade on).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

import pytest
import torch
import transformers

from kernels_fixtures import drive, make_checkpoint, restart_positions, zero_cached_kv
from kernels_fixtures import single_thread  # noqa: F401  (fixture)
from radixserve.bench.harness import bench_model_path
from radixserve.kernels import ForwardInput, ModelRunner

GAP = 0.5
MIN_DECISIVE = 2000
MIN_SHARE = 0.30
MIN_DECISIVE_AGREEMENT = 0.995
MAX_DEFICIT = 0.01  # (b): agreement points below transformers' own bf16

# Wider than kernels_fixtures.TINY, with larger weights: logits spread enough that most positions have a clear top-1.
WIDE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, initializer_range=0.2, max_position_embeddings=1024)
ARCHS = {
    "llama": ("llama", dict(head_dim=64, tie_word_embeddings=True)),  # head_dim != hidden / heads, tied
    "qwen2": ("qwen2", dict(num_key_value_heads=1)),  # q/k/v bias, GQA 4
    "qwen3": ("qwen3", dict(head_dim=64)),  # q/k norm per head
    "mistral": ("mistral", dict(sliding_window=48)),  # prompts longer than the window
}


@dataclass
class Agreement:
    positions: int = 0
    decisive: int = 0  # positions whose fp32 top-1 leads by more than GAP
    decisive_agree: int = 0  # ... where the engine's bf16 top-1 is fp32's
    engine_agree: int = 0  # all positions: engine bf16 top-1 == fp32 top-1
    hf_agree: int = 0  # all positions: transformers bf16 top-1 == fp32 top-1

    def report(self) -> str:
        return (f"{self.positions} positions, {self.decisive} decisive ({self.decisive / self.positions:.1%}): "
                f"engine bf16 agrees on {self.decisive_agree / self.decisive:.2%} of them; on all "
                f"{self.engine_agree / self.positions:.2%} (transformers bf16 {self.hf_agree / self.positions:.2%})")

    def failures(self) -> list[str]:
        """Which of the conditions fail: "counts" (too few decisive positions), "a", "b"."""
        failed = []
        if self.decisive < MIN_DECISIVE or self.decisive < MIN_SHARE * self.positions:
            failed.append("counts")
        if self.decisive_agree < MIN_DECISIVE_AGREEMENT * self.decisive:
            failed.append("a")
        if self.engine_agree < self.hf_agree - MAX_DEFICIT * self.positions:
            failed.append("b")
        return failed

    def check(self) -> None:
        print(self.report())
        assert not self.failures(), f"{self.failures()} failed: {self.report()}"


class _Top1:
    """A ModelRunner that hands drive() each position's top-1 token instead of its vocab-wide logits row."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.num_slots, self.context_length = runner, runner.num_slots, runner.context_length

    def forward_logits(self, seqs, shared):
        return [logits.argmax(-1) for logits in self.runner.forward_logits(seqs, shared)]


def _prompts(num_groups: int, per_group: int, prefix_len: int, tail_len: int, vocab: int,
             seed: int) -> tuple[list[list[int]], dict[int, tuple[int, int]]]:
    """Groups of prompts that share a prefix; within a group each prompt reads its prefix from the first's KV."""
    rng = random.Random(seed)
    prompts, share = [], {}
    for g in range(num_groups):
        prefix = [rng.randrange(4, vocab) for _ in range(prefix_len)]
        for i in range(per_group):
            if i:
                share[len(prompts)] = (g * per_group, prefix_len)
            prompts.append(prefix + [rng.randrange(4, vocab) for _ in range(tail_len + 8 * i)])
    return prompts, share


@torch.inference_mode()
def _measure(path: str, prompts: list[list[int]], share: dict[int, tuple[int, int]], chunk: int,
             logit_scale: float = 1.0, mutate: Callable[[ModelRunner], None] | None = None) -> Agreement:
    """Teacher-forced top-1 tokens of the engine in bf16 and of transformers in fp32 and bf16, compared.
    logit_scale multiplies the final norm's weight on both sides (a power of two: exact in either dtype)."""
    runner = ModelRunner(path, num_slots=sum(map(len, prompts)) + 64 * len(prompts), dtype="bfloat16",
                         attention_backend="torch", device="cpu")
    assert runner.k_cache.dtype == runner.v_cache.dtype == torch.bfloat16
    runner.model.final_norm.mul_(logit_scale)
    if mutate is not None:
        mutate(runner)
    reqs, stats = drive(_Top1(runner), prompts, [len(p) for p in prompts], 0, forced=True, chunk=chunk,
                        share=share, cascade=True)
    assert stats.reused_tokens > 0 and stats.shared_steps > 0
    del runner
    positions = [sorted(req.logits) for req in reqs]
    ours = [torch.stack([req.logits[p] for p in pos]) for req, pos in zip(reqs, positions)]
    result = Agreement()
    fp32_top1 = []
    for engine_top1, logits in zip(ours, _hf_logits(path, torch.float32, prompts, positions, logit_scale)):
        top2 = logits.topk(2, dim=-1)
        fp32_top1.append(top2.indices[:, 0])
        decisive = top2.values[:, 0] - top2.values[:, 1] > GAP
        result.positions += len(engine_top1)
        result.decisive += int(decisive.sum())
        result.decisive_agree += int((engine_top1 == fp32_top1[-1])[decisive].sum())
        result.engine_agree += int((engine_top1 == fp32_top1[-1]).sum())
    for expected, logits in zip(fp32_top1, _hf_logits(path, torch.bfloat16, prompts, positions, logit_scale)):
        result.hf_agree += int((logits.argmax(-1) == expected).sum())
    return result


def _hf_logits(path: str, dtype: torch.dtype, prompts: list[list[int]], positions: list[list[int]],
               logit_scale: float) -> Iterator[torch.Tensor]:
    """transformers' logits [len(positions[i]), vocab] (float32) of each prompt, one prompt at a time."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.model.norm.weight.mul_(logit_scale)
    for prompt, pos in zip(prompts, positions):
        yield model(torch.tensor([prompt])).logits[0, pos].float()


@pytest.mark.parametrize("name", list(ARCHS))
def test_bf16_parity_tiny(tmp_path, name, single_thread):
    _measure(_tiny_checkpoint(tmp_path, name), *_tiny_prompts(), chunk=29).check()


def _kv_cache_in_fp8(runner: ModelRunner) -> Callable[[ForwardInput], ForwardInput]:
    """A precision bug: the KV pool rounded to fp8 before every step."""
    def hook(fi: ForwardInput) -> ForwardInput:
        for cache in (runner.k_cache, runner.v_cache):
            cache.copy_(cache.to(torch.float8_e4m3fn).to(cache.dtype))
        return fi
    return hook


@pytest.mark.parametrize("mutation", ["restart_positions", "zero_cached_kv", "kv_cache_in_fp8"])
def test_bf16_parity_catches_mutations(tmp_path, mutation, single_thread):
    hooks = {"restart_positions": lambda runner: restart_positions, "zero_cached_kv": zero_cached_kv,
             "kv_cache_in_fp8": _kv_cache_in_fp8}

    def mutate(runner: ModelRunner) -> None:
        runner.forward_input_hook = hooks[mutation](runner)

    result = _measure(_tiny_checkpoint(tmp_path, "llama"), *_tiny_prompts(), chunk=29, mutate=mutate)
    assert result.failures() in (["a"], ["b"], ["a", "b"]), result.report()  # the counts come from fp32 alone


def _tiny_checkpoint(tmp_path, name: str) -> str:
    kind, overrides = ARCHS[name]
    return make_checkpoint(tmp_path / name, kind, seed=11, dtype=torch.bfloat16, **{**WIDE, **overrides})


def _tiny_prompts() -> tuple[list[list[int]], dict[int, tuple[int, int]]]:
    return _prompts(num_groups=4, per_group=5, prefix_len=128, tail_len=220, vocab=WIDE["vocab_size"], seed=5)


# Model L's fp32 top-1 leads by more than GAP on only ~2% of positions: random weights spread its logits over about
# one unit (a trained model's spread far wider). Its final norm's weight times L_LOGIT_SCALE, on both sides, spreads
# them 8x without changing either side's top-1 (a power of two scales bf16 and fp32 values exactly), so (a) reads
# the positions where L's own top-1 leads by more than GAP / 8.
L_LOGIT_SCALE = 8.0


def test_bf16_parity_model_l():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a 0.5B model: both cores pay off
    try:
        prompts, share = _prompts(num_groups=2, per_group=3, prefix_len=64, tail_len=600, vocab=151936, seed=7)
        _measure(bench_model_path("L"), prompts, share, chunk=200, logit_scale=L_LOGIT_SCALE).check()
    finally:
        torch.set_num_threads(before)
