"""Seeded random checkpoints (build_checkpoint) and the built-in demo model's on-disk cache."""
import json
import logging
import os
import threading

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixserve.bench.checkpoints import random_weights as demo
from radixserve.bench.checkpoints import build_checkpoint, cached_checkpoint, random_demo_model_path, special_token_ids

TINY = dict(vocab_size=300, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_each_arch_loads_in_transformers(tmp_path, arch):
    path = build_checkpoint(str(tmp_path), arch, head_dim=16, **TINY)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__.lower().startswith(arch)
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (300, 1, 2, 16)
    ids = special_token_ids(300)
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert len(AutoTokenizer.from_pretrained(path)) == 300
    logits = model(torch.tensor([[1, 2, 3]])).logits  # [1, 3, vocab]
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    paths = [build_checkpoint(str(tmp_path / name), seed=seed, **TINY) for name, seed in (("a", 1), ("b", 1), ("c", 2))]
    files = [open(os.path.join(p, "model.safetensors"), "rb").read() for p in paths]
    assert files[0] == files[1] and files[0] != files[2]


def test_overrides_dtype_and_sharding(tmp_path):
    path = build_checkpoint(
        str(tmp_path), "llama", dtype="bfloat16", initializer_range=0.1, rope_theta=5000.0,
        tie_word_embeddings=True, max_shard_size="20KB", **TINY,
    )
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] is True
    assert config.get("rope_theta", config.get("rope_parameters", {}).get("rope_theta")) == 5000.0
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 1
    with safe_open(os.path.join(path, shards[0]), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_checkpoint(str(tmp_path), "gpt2")
    with pytest.raises(ValueError, match="dtype"):
        build_checkpoint(str(tmp_path), dtype="float64")
    with pytest.raises(ValueError, match="vocab_size"):
        build_checkpoint(str(tmp_path), vocab_size=100)
    path = build_checkpoint(str(tmp_path / "bare"), vocab_size=100, tokenizer=False, **{k: v for k, v in TINY.items() if k != "vocab_size"})
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))


def test_random_demo_model_is_built_once_and_reused(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="radixserve.bench.checkpoints.random_weights"):
        path = random_demo_model_path()
    assert "RANDOM weights" in caplog.text
    assert os.path.dirname(path) == str(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 4, 4, 2)
    assert cfg.vocab_size == len(AutoTokenizer.from_pretrained(path)) == 2048
    assert cfg.max_position_embeddings == 4096
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the demo model was rebuilt")

    monkeypatch.setattr(demo, "build_checkpoint", fail)
    assert random_demo_model_path() == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # no temp dirs left behind


def test_concurrent_builders_agree_on_one_directory(tmp_path, monkeypatch):
    """Several threads (standing in for test processes) building the same entry all get one complete dir."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    start = threading.Barrier(3)
    results, errors = [], []

    def build(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write(str(threading.get_ident()))

    def worker():
        try:
            start.wait()
            results.append(demo._cached_dir("entry", build))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert os.listdir(results[0]) == ["config.json"]
    assert os.listdir(tmp_path) == ["entry"]


def test_cached_checkpoint_is_keyed_by_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    a = cached_checkpoint("llama", seed=1, **TINY)
    assert cached_checkpoint("llama", seed=1, **TINY) == a
    b = cached_checkpoint("llama", seed=2, **TINY)
    assert b != a and os.path.isfile(os.path.join(b, "model.safetensors"))


def test_bench_model_from_a_shape_file_or_a_checkpoint_dir(tmp_path, monkeypatch):
    """A config.json of a real model gives random weights in its shape (cached); a checkpoint directory is used as
    it is; anything else is a clear error."""
    from radixserve.bench.harness import BENCH_MODELS, bench_model_path
    from radixserve.kernels.model_config import load_model_config

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    shape = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=320, hidden_size=48,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32, intermediate_size=80,
                 max_position_embeddings=512, tie_word_embeddings=True, torch_dtype="bfloat16", rms_norm_eps=1e-5,
                 rope_theta=1e6, eos_token_id=151645, quantization_config={"quant_method": "ignored"})
    shape_file = tmp_path / "config.json"
    shape_file.write_text(json.dumps(shape))
    path = bench_model_path(str(shape_file))
    cfg = load_model_config(path)
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.max_position_embeddings) == (320, 48, 2, 4, 1, 32, 80, 512)
    assert (cfg.dtype, cfg.rms_norm_eps, cfg.rope.rope_theta) == ("bfloat16", 1e-5, 1e6)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.layers.0.self_attn.q_norm.weight").dtype == torch.bfloat16
    assert bench_model_path(str(shape_file)) == path  # built once
    assert bench_model_path(path) == path  # a checkpoint directory as it is
    assert BENCH_MODELS["L"]["vocab_size"] == 151936 and BENCH_MODELS["L"]["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="S, M, tiny, L"):
        bench_model_path("XL")
    with pytest.raises(ValueError, match="without config.json"):
        bench_model_path(str(tmp_path / "cache"))
    shape_file.write_text(json.dumps({**shape, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        bench_model_path(str(shape_file))
    shape_file.write_text(json.dumps({k: v for k, v in shape.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match="missing hidden_size"):
        bench_model_path(str(shape_file))
    shape_file.write_text("not json")
    with pytest.raises(ValueError, match="not a JSON config"):
        bench_model_path(str(shape_file))
