"""Writes a Llama-family Hugging Face checkpoint directory (safetensors, config.json, a byte-level BPE tokenizer.json)
as a GGUF file with the `gguf` package, in F32, F16, BF16, Q8_0 or Q4_0 (gguf.quants quantizes those two), for
tests and benches: the GGUF round trip, and models llama.cpp and radixserve load as the very same file.

The layout follows llama.cpp's: its tensor names, Llama's q / k rows reordered within each head for its rotary,
1-D tensors (norms, biases) kept in F32, a tensor whose rows do not split into the type's blocks kept in F32, the
tokenizer as token list, types and merges (pre-tokenizer "qwen2" for a Qwen2Tokenizer, else "gpt-2": a plain
byte-level split), and the chat template. `dequantized_copy` writes the float checkpoint the GGUF's values stand for (the reference a test compares
the loaded GGUF against).

    python -m radixserve.bench.checkpoints.gguf_export CHECKPOINT_DIR OUT.gguf --type Q8_0
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import replace

import numpy as np
import torch
from safetensors.torch import save_file

from ...kernels.layers import rope_inv_freq
from ...kernels.loader import read_safetensors, safetensors_files
from ...kernels.model_config import parse_model_config
from ...scheduler.tokenizer_files import pipeline_kind

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def export_gguf(model_dir: str, out_path: str, qtype: str = "F32") -> str:
    """Writes `model_dir` as the GGUF file `out_path` with its 2-D weights in `qtype`; returns out_path."""
    import gguf

    if qtype not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, got {qtype!r}")
    cfg = _read(model_dir, "config.json")
    arch = _ARCH[cfg["model_type"]]
    writer = gguf.GGUFWriter(out_path, arch)
    _write_config(writer, cfg)
    _write_tokenizer(writer, model_dir)
    factors = _rope_freq_factors(cfg)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    for name, tensor in _tensors(model_dir):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        gname = gguf_name(name)
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            tensor = _permute(tensor, heads if ".attn_q." in gname else kv_heads)
        kind = qtype if tensor.dim() > 1 else "F32"
        data, raw_dtype = encode(tensor.numpy(), kind)
        writer.add_tensor(gname, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def encode(array: np.ndarray, kind: str) -> tuple[np.ndarray, object]:
    """(data, GGML type) of a float32 array stored as `kind`; F32 where its rows do not split into blocks."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if kind == "F32" or array.shape[-1] % block:
        return np.ascontiguousarray(array, dtype=np.float32), gguf.GGMLQuantizationType.F32
    if kind == "F16":
        return array.astype(np.float16), qtype
    return quantize(array, qtype), qtype


def dequantized_copy(model_dir: str, out_dir: str, qtype: str) -> str:
    """A float32 copy of `model_dir` whose weights are what `export_gguf(..., qtype)` stores once dequantized."""
    from gguf.quants import dequantize

    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    state = {}
    for name, tensor in _tensors(model_dir):
        data, raw_dtype = encode(tensor.numpy(), qtype if tensor.dim() > 1 else "F32")
        state[name] = torch.from_numpy(np.array(dequantize(data, raw_dtype), dtype=np.float32)).reshape(tensor.shape)
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def _tensors(model_dir: str):
    """(name, float32 tensor) of each weight of the checkpoint, one at a time (never the model in float32)."""
    for path in safetensors_files(model_dir):
        for name, tensor in read_safetensors(path):
            yield name, tensor.float()


def gguf_name(name: str) -> str:
    """llama.cpp's name of an HF tensor name."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    _, _, idx, rest = name.split(".", 3)
    module, _, leaf = rest.rpartition(".")
    return f"blk.{idx}.{_LAYER[module]}.{leaf}"


def _permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF q / k rows to llama.cpp's order: within each head, row i of the first half next to row i of the second."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope_freq_factors(cfg: dict) -> np.ndarray | None:
    """llama.cpp's rope_freqs for a scaled rope other than linear (Llama 3.1's): each inverse frequency's divisor."""
    config = parse_model_config(cfg)
    if config.rope.rope_type in ("default", "linear"):
        return None
    plain = replace(config.rope, rope_type="default")
    return (rope_inv_freq(config.head_dim, plain) / rope_inv_freq(config.head_dim, config.rope)).numpy()


def _write_config(writer, cfg: dict) -> None:
    import gguf

    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(cfg["vocab_size"])
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))


def _write_tokenizer(writer, model_dir: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer metadata."""
    tok = _read(model_dir, "tokenizer.json")
    config = _read(model_dir, "tokenizer_config.json")
    if tok["model"]["type"] != "BPE" or (tok.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{model_dir}: only a plain byte-level BPE tokenizer.json is exported")
    vocab = dict(tok["model"]["vocab"])
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    for i, t in added.items():
        vocab[t["content"]] = i
    size = max(_read(model_dir, "config.json")["vocab_size"], max(vocab.values()) + 1)
    by_id = {i: s for s, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [(3 if added[i]["special"] else 4) if i in added else 1 if i in by_id else 5 for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    # the split the vocabulary was learned with: Qwen2Tokenizer's own regex where transformers builds that class
    writer.add_tokenizer_pre("qwen2" if pipeline_kind(model_dir, config) == "qwen2" else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos_ids = (_read(model_dir, "generation_config.json").get("eos_token_id")
               if os.path.isfile(os.path.join(model_dir, "generation_config.json")) else None) or []
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    named = {key: vocab.get(_content(config.get(key))) for key in ("bos_token", "eos_token", "pad_token")}
    eos = named["eos_token"] if named["eos_token"] is not None else (eos_ids[0] if eos_ids else None)
    if eos is not None:
        writer.add_eos_token_id(eos)
    eot = next((i for i in eos_ids if i != eos), None)
    if eot is not None:
        writer.add_eot_token_id(eot)
    if named["bos_token"] is not None:
        writer.add_bos_token_id(named["bos_token"])
    if named["pad_token"] is not None:
        writer.add_pad_token_id(named["pad_token"])
    writer.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)


def _content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _read(model_dir: str, name: str) -> dict:
    with open(os.path.join(model_dir, name), encoding="utf-8") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--type", default="F32", choices=TYPES)
    args = parser.parse_args()
    print(export_gguf(args.checkpoint, args.out, args.type))


if __name__ == "__main__":
    main()
