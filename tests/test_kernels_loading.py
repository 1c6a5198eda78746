"""Checkpoint loading: config layouts, EOS ids, sharded weights, dtypes and clear errors."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from kernels_fixtures import hf_logits, load_hf, make_checkpoint, make_prompts
from kernels_fixtures import single_thread  # noqa: F401  (fixture)
from radixserve.kernels import ModelRunner, RopeConfig, SeqInput, load_model_config
from radixserve.kernels.loader import BF16_CPU_FLAGS, cpu_flags, resolve_dtype
from radixserve.kernels.model_config import parse_model_config

pytestmark = pytest.mark.usefixtures("single_thread")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama_load"), "llama", seed=7)


def _copy_with_config(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        raw = json.load(f)
    edit(raw)
    with open(path, "w") as f:
        json.dump(raw, f)
    return str(dst)


def _prompt_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    seq = SeqInput(input_ids=prompt, prefix_len=0, row=0, new_slots=list(range(len(prompt))), slot_offset=0,
                   new_row=True, sample=False)
    return runner.forward_logits([seq])[0]


def test_config_fields_and_eos_ids(llama_path):
    cfg = load_model_config(llama_path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.vocab_size == 256 and cfg.sliding_window is None
    assert cfg.eos_token_ids == (2, 3)  # generation_config.json's list, then config.json's 2
    assert cfg.rope == RopeConfig(rope_type="default", rope_theta=10000.0)


def test_old_and_new_rope_layouts_agree():
    base = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
                num_hidden_layers=2, intermediate_size=128, vocab_size=256, eos_token_id=5)
    new = parse_model_config({**base, "rope_parameters": LLAMA3_ROPE})
    old_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    old = parse_model_config({**base, "rope_theta": 5000.0, "rope_scaling": old_scaling}, {"eos_token_id": 9})
    assert new.rope == old.rope and new.rope.original_max_position_embeddings == 32
    assert old.eos_token_ids == (9, 5) and new.eos_token_ids == (5,)
    legacy_type = parse_model_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy_type.rope == RopeConfig(rope_type="linear", rope_theta=10000.0, factor=2.0)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    LLAMA3_ROPE,
])
def test_rope_inv_freq_matches_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from radixserve.kernels.layers import rope_inv_freq

    hf_config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters=rope)
    if rope["rope_type"] == "default":
        expected, _ = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
            hf_config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    ours = rope_inv_freq(32, parse_model_config({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}).rope)
    assert torch.equal(ours, expected.float())


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_rotary_on_interleaved_pairs_equals_transformers_rotate_half(dtype, atol):
    """The loader stores q / k head dims in rotary-pair order; rotating there and reading back in the checkpoint's
    order equals transformers' rotate-half on the original (float32: the complex path; else the strided one)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from radixserve.kernels.layers import RotaryEmbedding, apply_rotary, interleave_rotary_pairs, pair_interleave

    head_dim, positions = 32, torch.tensor([0, 1, 7, 300, 4095])
    rotary = RotaryEmbedding(head_dim, RopeConfig(rope_type="default", rope_theta=10000.0), "cpu")
    angles = positions.float()[:, None] * rotary.inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    x = torch.randn(len(positions), 3, head_dim).to(dtype)  # [tokens, heads, head_dim]
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), emb.cos().to(dtype),
                                       emb.sin().to(dtype), unsqueeze_dim=0)
    flat = interleave_rotary_pairs(x.reshape(len(positions), -1).t().contiguous(), head_dim).t()
    ours = apply_rotary(flat.reshape(x.shape).contiguous(), rotary.rotation(positions, dtype))
    back = torch.empty_like(ours)
    back[..., pair_interleave(head_dim)] = ours  # the checkpoint's order again
    assert back.dtype == dtype
    torch.testing.assert_close(back.float(), expected.transpose(0, 1).float(), atol=atol, rtol=0)
    # A strided input (its pairs not adjacent in memory) gives the same result.
    assert torch.equal(apply_rotary(flat.reshape(x.shape), rotary.rotation(positions, dtype)), ours)


def test_qwen2_sliding_window_layers():
    base = dict(architectures=["Qwen2ForCausalLM"], hidden_size=64, num_attention_heads=4,
                num_hidden_layers=4, intermediate_size=128, vocab_size=256, sliding_window=32)
    assert parse_model_config(base).layer_sliding_windows == (None,) * 4  # use_sliding_window off
    on = parse_model_config({**base, "use_sliding_window": True, "max_window_layers": 2})
    assert on.layer_sliding_windows == (None, None, 32, 32) and on.sliding_window == 32
    assert on.qkv_bias and not on.o_bias


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    path = make_checkpoint(tmp_path / "sharded", "qwen2", seed=3, max_shard_size="40KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1
    runner = ModelRunner(path, num_slots=64, attention_backend="torch", device="cpu")
    prompt = make_prompts(1, shared_len=0, tail_lens=[20], vocab=256, seed=1)[0]
    assert torch.allclose(_prompt_logits(runner, prompt), hf_logits(load_hf(path), prompt), atol=1e-4)


def test_bfloat16_runs_close_to_float32(llama_path):
    fp32 = ModelRunner(llama_path, num_slots=64, dtype="auto", attention_backend="torch", device="cpu")
    bf16 = ModelRunner(llama_path, num_slots=64, dtype="bfloat16", attention_backend="torch", device="cpu",
                       context_length=100)
    assert fp32.dtype == torch.float32 and fp32.config.dtype == "float32"  # "auto" on the CPU
    assert bf16.k_cache.dtype == torch.bfloat16 and bf16.config.dtype == "bfloat16"
    assert bf16.context_length == 100 and fp32.context_length == 256
    prompt = make_prompts(1, shared_len=0, tail_lens=[12], vocab=256, seed=4)[0]
    a, b = _prompt_logits(fp32, prompt), _prompt_logits(bf16, prompt)
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


@pytest.mark.parametrize("requested, ckpt, flags, expected", [
    ("auto", "bfloat16", {"avx512_bf16"}, torch.bfloat16),
    ("auto", "bfloat16", {"amx_bf16", "avx512f"}, torch.bfloat16),
    ("auto", "bfloat16", {"avx512f", "avx2"}, torch.float32),  # no native bf16 dot products
    ("auto", "float32", {"avx512_bf16", "amx_bf16"}, torch.float32),  # an fp32 checkpoint stays fp32
    ("auto", "float16", {"avx512_bf16"}, torch.float32),
    ("bfloat16", "float32", set(), torch.bfloat16),  # asked for: whatever the CPU
])
def test_auto_dtype_on_the_cpu(requested, ckpt, flags, expected, caplog):
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.loader"):
        assert resolve_dtype(requested, ckpt, torch.device("cpu"), frozenset(flags)) == expected
    [line] = [r.getMessage() for r in caplog.records]  # one line: which dtype and why
    assert line.startswith(f"dtype {str(expected).removeprefix('torch.')} (")
    assert ("this CPU has no" in line) == (requested == "auto" and ckpt == "bfloat16" and expected == torch.float32)


def test_bf16_checkpoint_runs_in_bf16_where_the_cpu_has_it(llama_path, tmp_path):
    path = make_checkpoint(tmp_path / "bf16", "llama", seed=7, dtype=torch.bfloat16)  # llama_path's weights in bf16
    assert load_model_config(path).dtype == "bfloat16"
    runner = ModelRunner(path, num_slots=64, attention_backend="torch", device="cpu")
    native_bf16 = bool(set(BF16_CPU_FLAGS) & cpu_flags())
    assert runner.dtype == (torch.bfloat16 if native_bf16 else torch.float32)
    assert runner.k_cache.dtype == runner.v_cache.dtype == runner.model.embed.dtype == runner.dtype  # the KV pool too
    prompt = make_prompts(1, shared_len=0, tail_lens=[12], vocab=256, seed=4)[0]
    a, b = _prompt_logits(runner, prompt), hf_logits(load_hf(llama_path), prompt)
    assert (a - b).abs().max().item() < 0.1 * b.abs().max().item()


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.update(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (lambda raw: raw.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "yarn"),
    (lambda raw: raw.update(hidden_act="gelu"), "gelu"),
    (lambda raw: raw.update(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "per layer type"),
])
def test_unsupported_config_is_a_clear_error(llama_path, tmp_path, edit, message):
    path = _copy_with_config(llama_path, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        ModelRunner(path, num_slots=8, device="cpu")


def test_missing_files_are_clear_errors(llama_path, tmp_path):
    no_weights = _copy_with_config(llama_path, tmp_path / "no_weights", lambda raw: None)
    os.remove(os.path.join(no_weights, "model.safetensors"))
    with pytest.raises(ValueError, match=r"safetensors"):
        ModelRunner(no_weights, num_slots=8, device="cpu")
    with open(os.path.join(no_weights, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        ModelRunner(no_weights, num_slots=8, device="cpu")
    with pytest.raises(ValueError, match="config.json"):
        ModelRunner(str(tmp_path), num_slots=8, device="cpu")
    with pytest.raises(ValueError, match="not a directory"):
        ModelRunner(str(tmp_path / "nowhere"), num_slots=8, device="cpu")


def test_bad_runner_arguments_and_inputs(llama_path):
    with pytest.raises(ValueError, match="attention_backend"):
        ModelRunner(llama_path, num_slots=8, attention_backend="flash", device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(llama_path, num_slots=8, dtype="int8", device="cpu")
    runner = ModelRunner(llama_path, num_slots=8, device="cpu", context_length=6)
    def seq(ids, slots, row=0, offset=0):
        return SeqInput(input_ids=ids, prefix_len=0, row=row, new_slots=slots, slot_offset=offset,
                        new_row=offset == 0, sample=True)
    with pytest.raises(ValueError, match="holds 1 slots"):
        runner.forward([seq([5, 6], [0])])
    with pytest.raises(ValueError, match="slot ids"):
        runner.forward([seq([5], [8])])
    with pytest.raises(ValueError, match="context length"):
        runner.forward([seq([5] * 7, list(range(7)))])
    with pytest.raises(ValueError, match="row must be"):
        runner.forward([seq([5], [0], row=64)])
    with pytest.raises(ValueError, match="twice"):
        runner.forward([seq([5], [0]), seq([6], [1])])
    with pytest.raises(ValueError, match="gap"):
        runner.forward([seq([5], [3], row=1, offset=2)])
