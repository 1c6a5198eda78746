"""Greedy parity of the whole engine (add_request/step, radix cache, chunking, pages) with HF."""
from __future__ import annotations

import pytest

from _engine_helpers import (check_greedy_against_hf, drive_staggered, hf_greedy, hf_model, make_checkpoint,
                             shared_prefix_prompts)
from kernels_fixtures import restart_positions, zero_cached_kv
from radixserve.kernels import native as native_kernel
from radixserve.scheduler import Engine

NUM_NEW = 32
GREEDY = dict(max_new_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=3)

ARCH_CASES = {
    # GQA 2, explicit head_dim != hidden/heads, non-default rope_theta
    "llama": dict(arch="llama", num_heads=4, num_kv_heads=2, head_dim=24, rope_theta=50000.0),
    "llama3_scaling": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2_bias_tied": dict(arch="qwen2", num_kv_heads=1, tie_word_embeddings=True),
    "qwen3_qk_norm": dict(arch="qwen3", num_kv_heads=2, head_dim=32),
    "mistral_window": dict(arch="mistral", sliding_window=16),
}


def _run(ckpt: str, prompts, shared: bool = True, **engine_kwargs):
    """shared: shared-prefix attention forced on (threshold 0) and asserted to have run; else off."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=4096, shared_prefix_min_tokens=0,
                    disable_shared_prefix_attention=not shared, **engine_kwargs)
    # The native kernel reads wherever it serves the head_dim (multiples of 32), unless disabled.
    runner = engine.runner
    native = (not engine_kwargs.get("disable_native_kernels", False)
              and native_kernel.supports(runner.dtype, runner.config.head_dim, runner.device))
    assert runner.backend.native == native
    assert runner.attention == (native_kernel.status() if native else "torch flash op")
    out = drive_staggered(engine, prompts, GREEDY)
    engine.check_integrity()
    stats = engine.stats()
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    cache_on = not engine_kwargs.get("disable_radix_cache", False)
    assert (stats["num_shared_prefix_steps"] > 0) == (shared and cache_on), stats["num_shared_prefix_steps"]
    return out


def _check(ckpt: str, prompts, out, expect_hits: bool = True) -> None:
    model = hf_model(ckpt)
    check_greedy_against_hf(model, prompts, out, NUM_NEW)
    # HF generate itself, on one prompt, as the token-level reference too.
    assert out.results[out.rids[0]].output_ids[:8] == hf_greedy(model, prompts[0], 8)
    # The scenario really happened: cache hits and steps mixing prefill with decode.
    assert out.num_mixed_steps > 0
    hits = [out.results[r].cached_tokens for r in out.rids]
    assert any(hits) if expect_hits else not any(hits)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_arch_parity(tmp_path_factory, case, shared):
    cfg = dict(ARCH_CASES[case])
    ckpt = make_checkpoint(tmp_path_factory, f"{case}_{shared}", **cfg)
    prompts = shared_prefix_prompts(prefix_len=40)
    _check(ckpt, prompts, _run(ckpt, prompts, shared=shared))


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "llama_grid", arch="llama", num_kv_heads=2, head_dim=32)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("cache_off", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [512, 12])
def test_llama_grid_parity(llama_ckpt, cache_off, page_size, chunk, shared):
    prompts = shared_prefix_prompts(prefix_len=40)
    out = _run(llama_ckpt, prompts, shared=shared, disable_radix_cache=cache_off, page_size=page_size,
               chunked_prefill_size=chunk)
    _check(llama_ckpt, prompts, out, expect_hits=not cache_off)


@pytest.mark.parametrize("forced_by", ["disable_native_kernels", "no library"])
def test_llama_parity_on_torch_flash_op(llama_ckpt, forced_by, monkeypatch):
    """The grid's head_dim takes the native kernel where it builds; the fallback reader (the torch
    twin over the flash op) where it is switched off or the library cannot be had (load() None)."""
    prompts = shared_prefix_prompts(prefix_len=40)
    if forced_by == "no library":
        monkeypatch.setattr(native_kernel, "load", lambda: None)
    flags = {"disable_native_kernels": True} if forced_by == "disable_native_kernels" else {}
    out = _run(llama_ckpt, prompts, page_size=16, chunked_prefill_size=12, **flags)
    _check(llama_ckpt, prompts, out)


@pytest.mark.parametrize("mutation", ["restart_positions", "zero_cached_kv"])
def test_engine_parity_catches_mutations(llama_ckpt, mutation):
    """The same parity check fails when the engine's cached-prefix handling is broken."""
    prompts = shared_prefix_prompts(prefix_len=40)
    engine = Engine(llama_ckpt, num_threads=1, kv_cache_tokens=4096, chunked_prefill_size=12,
                    shared_prefix_min_tokens=0)
    hook = restart_positions if mutation == "restart_positions" else zero_cached_kv(engine.runner)
    engine.runner.forward_input_hook = hook
    out = drive_staggered(engine, prompts, GREEDY)
    assert engine.stats()["num_shared_prefix_steps"] > 0  # the mutated run used shared prefixes
    with pytest.raises(AssertionError, match=r"token \d+: (ours|logprob)"):
        _check(llama_ckpt, prompts, out)
