"""The model runner with attention_backend="triton" (interpreter on the CPU) vs "torch" and HF.

A tiny head_dim-64 checkpoint (GQA 2; a Mistral variant with a sliding window shorter than the
prompts) is driven through chunked prefills, prefix reuse across requests, mixed
prefill + decode steps and scattered page slots, by the kernels helpers' mini scheduler.
"""
from __future__ import annotations

import pytest
import torch

from kernels_fixtures import drive, hf_greedy, load_hf, make_checkpoint, make_prompts
from radixserve.kernels import ModelRunner

NUM_NEW = 6
VARIANTS = {
    "llama": ("llama", dict(head_dim=64)),
    "mistral_window": ("mistral", dict(head_dim=64, sliding_window=12)),
}


def _scenario():
    prompts = make_prompts(3, shared_len=10, tail_lens=[9, 14, 5], vocab=256, seed=1)
    prompts[2] = prompts[0] + prompts[2][10:]  # extends the whole of prompt 0
    return prompts, {1: (0, 10), 2: (0, len(prompts[0]))}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_triton_runner_matches_torch_and_hf(tmp_path, name):
    kind, overrides = VARIANTS[name]
    path = make_checkpoint(tmp_path / name, kind, seed=4, **overrides)
    prompts, share = _scenario()
    hf = load_hf(path)

    runners = {backend: ModelRunner(path, num_slots=512, attention_backend=backend, device="cpu")
               for backend in ("torch", "triton")}
    assert runners["triton"].backend.name == "triton"
    # Teacher-forced logits over prompt + HF's greedy continuation: the two backends agree.
    outputs = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    full = [p + o for p, o in zip(prompts, outputs)]
    logits = {}
    for backend, runner in runners.items():
        reqs, stats = drive(runner, full, [len(p) for p in prompts], NUM_NEW, forced=True, share=share, chunk=7)
        assert stats.mixed_steps > 0 and stats.reused_tokens > 0
        # Positions reused from another request's slots were not recomputed, so have no logits.
        logits[backend] = [torch.stack([r.logits[i] for i in sorted(r.logits)]) for r in reqs]
    for ours, ref in zip(logits["triton"], logits["torch"]):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)

    # Greedy generation with the Triton backend reproduces HF's tokens.
    reqs, _ = drive(runners["triton"], prompts, [len(p) for p in prompts], NUM_NEW, forced=False, share=share,
                    chunk=7, slot_seed=3)
    assert [r.output for r in reqs] == outputs
