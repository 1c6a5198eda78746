"""A GGUF file of seeded random weights in a model's shape, written directly in a block type (Q4_0 or Q8_0, by the
`gguf` package's quantizer) one tensor at a time: no float copy of the model exists, in memory or on disk, and the
writer streams (tensor infos first, then each tensor's data as it is made), so an 8B model's Q4_0 file (~4.7 GB)
takes a few hundred MB to write. The metadata, tokenizer (the demo kit's byte-level BPE, padded to the vocabulary)
and tensor layout are gguf_export's, so radixserve and llama.cpp load the file as they load an exported one.

    python -m radixserve.bench.checkpoints.gguf_random /tmp/peers/gguf/llama8b-q4_0.gguf --shape llama-3.1-8b
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any, Iterator

import numpy as np
import torch

from . import gguf_export
from .random_weights import _make_config, _special_ids_for_config
from ..demo_kit.tokenizer import build_tokenizer, write_generation_config

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "tiny": dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=2048, tie_word_embeddings=False),
}
ROWS_AT_ONCE = 1 << 22  # weights made and quantized at a time (float32 temporaries of ~16 MB)


def write_random_gguf(out_path: str, shape: dict[str, Any], qtype: str = "Q4_0", seed: int = 0,
                      std: float = 0.02) -> str:
    """Writes a Llama-shaped GGUF of N(0, std) weights (norms 1) in `qtype` to out_path (via a .part file)."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="radixserve-gguf-") as meta_dir:
        cfg = _metadata_dir(meta_dir, shape)
        tmp = out_path + ".part"
        writer = gguf.GGUFWriter(tmp, "llama")
        gguf_export._write_config(writer, cfg)
        gguf_export._write_tokenizer(writer, meta_dir)
        factors = gguf_export._rope_freq_factors(cfg)
        if factors is not None:
            writer.add_tensor("rope_freqs.weight", factors)
        tensors = list(_shapes(cfg))
        for name, dims in tensors:
            kind = qtype if len(dims) > 1 else "F32"
            raw = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[raw]
            byte_shape = (*dims[:-1], dims[-1] // block * size) if kind != "F32" else dims
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8 if kind != "F32" else np.float32),
                                   int(np.prod(byte_shape)) * (1 if kind != "F32" else 4), raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if factors is not None:
            writer.write_tensor_data(np.ascontiguousarray(factors, dtype=np.float32))
        gen = torch.Generator().manual_seed(seed)
        for name, dims in tensors:
            writer.write_tensor_data(_encoded(dims, qtype, gen, std))
        writer.close()
    os.replace(tmp, out_path)
    return out_path


def _metadata_dir(folder: str, shape: dict[str, Any]) -> dict[str, Any]:
    """config.json, the tokenizer and generation_config.json of the shape in `folder` (no weights); the config."""
    shape = dict(shape)
    config = _make_config("llama", head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                          **_special_ids_for_config(shape["vocab_size"]), **shape)
    config.save_pretrained(folder)
    build_tokenizer(folder, shape["vocab_size"])
    write_generation_config(folder, shape["vocab_size"])
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, dims as numpy orders them: rows first) of every tensor, in llama.cpp's order."""
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    yield "token_embd.weight", (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        for leaf, dims in (("attn_norm", (hidden,)), ("attn_q", (q, hidden)), ("attn_k", (kv, hidden)),
                           ("attn_v", (kv, hidden)), ("attn_output", (hidden, q)), ("ffn_norm", (hidden,)),
                           ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)), ("ffn_down", (hidden, inter))):
            yield f"blk.{i}.{leaf}.weight", dims
    yield "output_norm.weight", (hidden,)
    if not cfg.get("tie_word_embeddings"):
        yield "output.weight", (vocab, hidden)


def _encoded(dims: tuple[int, ...], qtype: str, gen: torch.Generator, std: float) -> np.ndarray:
    """A tensor of `dims` made and encoded a block of rows at a time (norms: ones, in F32)."""
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)
    rows, cols = dims
    step = max(1, ROWS_AT_ONCE // cols)
    parts = [gguf_export.encode((torch.randn(min(step, rows - r), cols, generator=gen) * std).numpy(), qtype)[0]
             for r in range(0, rows, step)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_random_gguf(args.out, SHAPES[args.shape], args.type, args.seed))


if __name__ == "__main__":
    main()
