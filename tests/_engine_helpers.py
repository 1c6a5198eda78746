"""Shared helpers for engine-level tests: tiny checkpoints, a staggered driver, HF references."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from radixserve.bench.checkpoints import build_checkpoint


def make_checkpoint(tmp_path_factory, name: str, arch: str = "llama", **overrides) -> str:
    out = tmp_path_factory.mktemp(name)
    kwargs = dict(seed=0, vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=128, initializer_range=0.1)
    kwargs.update(overrides)
    return build_checkpoint(str(out), arch, **kwargs)


def shared_prefix_prompts(num_prompts: int = 8, prefix_len: int = 40, seed: int = 0,
                          low: int = 10, high: int = 400) -> list[list[int]]:
    """Prompts in two families sharing prefixes; some extend others exactly."""
    rng = random.Random(seed)
    base = [rng.randrange(low, high) for _ in range(prefix_len)]
    other = base[:prefix_len // 2] + [rng.randrange(low, high) for _ in range(prefix_len // 2)]
    prompts = []
    for i in range(num_prompts):
        root = base if i % 2 == 0 else other
        tail = [rng.randrange(low, high) for _ in range(3 + 2 * i)]
        prompts.append(root + tail)
    prompts[-1] = prompts[0] + [rng.randrange(low, high) for _ in range(7)]  # extends another prompt
    return prompts


@dataclass
class DriveResult:
    results: dict  # rid -> GenerateResult
    rids: list[str]
    num_mixed_steps: int


def drive_staggered(engine, prompts, params, first: int = 2, every: int = 2) -> DriveResult:
    """Add `first` prompts, then one more every `every` steps, so that new prefills run next
    to decodes and later prompts can hit prefixes cached by earlier ones."""
    rids = [engine.add_request(p, params) for p in prompts[:first]]
    pending = list(prompts[first:])
    results = {}
    step = 0
    while engine.has_unfinished() or pending:
        if pending and step % every == 0:
            rids.append(engine.add_request(pending.pop(0), params))
        for delta in engine.step():
            if delta.finished:
                results[delta.rid] = delta.result
        step += 1
        assert step < 10_000, "engine made no progress"
    return DriveResult(results, rids, engine.stats()["num_mixed_steps"])


def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of the logits at every position: [len(ids), vocab]."""
    logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def check_greedy_against_hf(model, prompts: list[list[int]], out: DriveResult, num_new: int) -> None:
    """Every request of a drive ran to its length, and each matches HF (one near-tie allowed overall)."""
    ties = 1
    for rid, prompt in zip(out.rids, prompts):
        result = out.results[rid]
        assert result.completion_tokens == num_new and result.finish_reason == "length"
        ties = compare_with_hf(model, prompt, result, ties)


def compare_with_hf(model, prompt: list[int], result, ties_left: int) -> int:
    """Assert our greedy tokens and logprobs match HF teacher-forced; returns ties left.

    A divergence is a tie only where HF's top-2 gap (float64) is < 1e-4; the comparison of
    that prompt stops there.
    """
    ours = result.output_ids
    ref_lp = hf_logprobs(model, prompt + ours)  # [L + n, vocab]
    for i, tok in enumerate(ours):
        row = ref_lp[len(prompt) + i - 1]
        top2 = torch.topk(row, 2).values
        ref_tok = int(row.argmax())
        if tok != ref_tok:
            gap = float(top2[0] - top2[1])
            assert gap < 1e-4 and ties_left > 0, (
                f"token {i}: ours {tok} vs HF {ref_tok} (top-2 gap {gap:.2e}, ties left {ties_left})")
            return ties_left - 1
        lp = result.logprobs[i]
        assert abs(lp.logprob - float(row[tok])) < 1e-4, f"token {i}: logprob {lp.logprob} vs HF {float(row[tok])}"
        for alt_id, alt_lp in lp.top:
            assert abs(alt_lp - float(row[alt_id])) < 1e-4, f"token {i}: top logprob of {alt_id} differs"
    return ties_left
