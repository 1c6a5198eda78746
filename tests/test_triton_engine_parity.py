"""Engine-level greedy parity with attention_backend="triton" forced (interpreter on the CPU).

One tiny head_dim-64 Llama (GQA 2) with page size 16 and chunked prefill: staggered requests
sharing prefixes give cache hits and steps that mix prefill chunks with decodes, so the
Triton store / extend / decode kernels all run inside the real engine loop.
"""
from __future__ import annotations

from _engine_helpers import check_greedy_against_hf, drive_staggered, hf_model, make_checkpoint, shared_prefix_prompts
from radixserve.scheduler import Engine

NUM_NEW = 8
GREEDY = dict(max_new_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=2)


def test_engine_greedy_parity_with_triton_backend(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory, "triton_llama64", arch="llama", hidden_size=128, num_heads=4,
                           num_kv_heads=2, head_dim=64)
    prompts = shared_prefix_prompts(num_prompts=4, prefix_len=20, seed=2)
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024, attention_backend="triton", page_size=16, chunked_prefill_size=16)
    assert engine.runner.backend.name == "triton"
    try:
        out = drive_staggered(engine, prompts, GREEDY)
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert out.num_mixed_steps > 0
    assert any(out.results[rid].cached_tokens for rid in out.rids), "later prompts should hit the cache"
    model = hf_model(ckpt)
    check_greedy_against_hf(model, prompts, out, NUM_NEW)
