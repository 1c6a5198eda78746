"""Runner-level parity with transformers (fp32): teacher-forced logits and greedy tokens.

Each variant is a seeded tiny checkpoint saved with save_pretrained; the mini scheduler in
kernels_fixtures drives chunked prefills, prefix reuse across requests (KV written by an
earlier forward into other slots), mixed prefill + decode steps and scattered slot ids.
Mutation checks show that the comparison catches wrong positions, lost KV and a dropped window.
"""
from __future__ import annotations

import pytest
import torch

from kernels_fixtures import (drive, hf_greedy, hf_logits, load_hf, make_checkpoint, make_prompts, restart_positions,
                              zero_cached_kv)
from kernels_fixtures import single_thread  # noqa: F401  (fixture)
from radixserve.kernels import ModelRunner

pytestmark = pytest.mark.usefixtures("single_thread")

ATOL = 1e-4
NUM_NEW = 32
VARIANTS = {
    # GQA 2, explicit head_dim (32 != 64 / 4), non-default rope_theta, tied embeddings
    "llama": ("llama", dict(head_dim=32, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # llama3 scaling with original_max_position_embeddings exceeded by every prompt; GQA 4; biases
    "llama3": ("llama", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16})),
    "qwen2": ("qwen2", dict(num_key_value_heads=1)),  # q/k/v bias
    "qwen3": ("qwen3", dict(head_dim=32)),  # q/k norm per head
    "mistral": ("mistral", dict(sliding_window=16)),  # every prompt is longer than the window
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            kind, overrides = VARIANTS[name]
            built[name] = make_checkpoint(tmp_path_factory.mktemp(name), kind, seed=len(built), **overrides)
        return built[name]

    return get


def _scenario():
    prompts = make_prompts(5, shared_len=14, tail_lens=[12, 20, 7, 26, 16], vocab=256, seed=3)
    prompts[4] = prompts[1] + prompts[4][14:]  # extends the whole of prompt 1
    share = {2: (0, 14), 3: (0, 14), 4: (1, len(prompts[1]))}
    return prompts, share


def _reference(hf, prompts):
    outputs = [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    assert all(len(o) == NUM_NEW for o in outputs)
    full = [p + o for p, o in zip(prompts, outputs)]
    return outputs, full, [hf_logits(hf, f) for f in full]


def _max_logit_error(runner, prompts, share, full, ref_logits, cascade: bool = False) -> float:
    reqs, stats = drive(runner, full, [len(p) for p in prompts], NUM_NEW, forced=True, share=share, cascade=cascade)
    assert stats.reused_tokens > 0 and stats.mixed_steps > 0
    assert (stats.shared_steps > 0) == cascade
    err = 0.0
    for req, ref in zip(reqs, ref_logits):
        positions = sorted(req.logits)
        ours = torch.stack([req.logits[p] for p in positions])
        err = max(err, (ours - ref[positions]).abs().max().item())
    return err


def _count_greedy_ties(ours: list[list[int]], ref: list[list[int]], ref_logits, prompts) -> int:
    """Number of prompts that diverge at a genuine tie (HF top-2 gap < ATOL); fails otherwise."""
    ties = 0
    for out, expected, logits, prompt in zip(ours, ref, ref_logits, prompts):
        for t, (a, b) in enumerate(zip(out, expected)):
            if a != b:
                top2 = logits[len(prompt) - 1 + t].double().topk(2).values
                assert (top2[0] - top2[1]).item() < ATOL, f"greedy token {t} differs: {a} vs HF {b}"
                ties += 1
                break
    return ties


@pytest.mark.parametrize("name", list(VARIANTS))
def test_runner_matches_transformers(checkpoint, name):
    path = checkpoint(name)
    hf = load_hf(path)
    runner = ModelRunner(path, num_slots=1024, attention_backend="torch", device="cpu")
    prompts, share = _scenario()
    ref_out, full, ref_logits = _reference(hf, prompts)

    reqs, stats = drive(runner, [list(p) for p in prompts], [len(p) for p in prompts], NUM_NEW,
                        forced=False, share=share)
    assert stats.reused_tokens > 0 and stats.mixed_steps > 0
    assert all(len(r.output) == NUM_NEW for r in reqs)
    assert _count_greedy_ties([r.output for r in reqs], ref_out, ref_logits, prompts) <= 1

    assert _max_logit_error(runner, prompts, share, full, ref_logits) <= ATOL
    # The same with the shared prefixes handed to the runner (read once, merged by log-sum-exp).
    assert _max_logit_error(runner, prompts, share, full, ref_logits, cascade=True) <= ATOL


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_torch_pointwise_ops_match_too(checkpoint, monkeypatch, name):
    """The forward's torch twins of the native elementwise calls (kernels/pointwise.py), where the library is
    missing: the same parity."""
    from radixserve.kernels import pointwise
    calls = []
    monkeypatch.setattr(pointwise, "usable", lambda x: calls.append(1) and False)
    path = checkpoint(name)
    runner = ModelRunner(path, num_slots=1024, attention_backend="torch", device="cpu")
    prompts, share = _scenario()
    _, full, ref_logits = _reference(load_hf(path), prompts)
    assert _max_logit_error(runner, prompts, share, full, ref_logits) <= ATOL
    assert calls


@pytest.mark.parametrize("mutation", ["restart_positions", "zero_cached_kv", "drop_window"])
def test_parity_check_catches_mutations(checkpoint, monkeypatch, mutation):
    name = "mistral" if mutation == "drop_window" else "llama"
    path = checkpoint(name)
    runner = ModelRunner(path, num_slots=1024, attention_backend="torch", device="cpu")
    prompts, share = _scenario()
    _, full, ref_logits = _reference(load_hf(path), prompts)
    assert _max_logit_error(runner, prompts, share, full, ref_logits) <= ATOL  # sane before mutating

    if mutation == "restart_positions":
        monkeypatch.setattr(runner, "forward_input_hook", restart_positions)
    elif mutation == "zero_cached_kv":
        monkeypatch.setattr(runner, "forward_input_hook", zero_cached_kv(runner))
    else:
        for layer in runner.model.layers:
            monkeypatch.setattr(layer, "sliding_window", None)
    err = _max_logit_error(runner, prompts, share, full, ref_logits)
    assert err > 10 * ATOL, f"mutation {mutation} went unnoticed (max logit error {err})"
