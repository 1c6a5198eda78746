"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened batch of tokens.

One forward takes the new tokens of every sequence of a step side by side
([num_tokens] ids and absolute positions) and attends over the paged KV pool through an
attention backend. q/k/v and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention.base import AttentionBackend, AttentionMetadata
from . import pointwise, quant
from .layers import (Linear, RotaryEmbedding, apply_rotary, interleave_rotary_pairs, rms_norm,
                                      silu_and_mul)
from .loader import take, take_optional
from .model_config import ModelConfig
from .quant_spec import QuantSpec

logger = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o: Linear  # num_heads * head_dim -> hidden
    q_norm: torch.Tensor | None  # [head_dim], Qwen3
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    sliding_window: int | None


class CausalLM:
    """Weights plus the forward of a Llama-family causal LM (no nn.Module: nothing to train)."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device,
                 quantization: QuantSpec | None = None) -> None:
        """`state` as loader.load_state_dict gives it; with `quantization` its linear weights are already
        quant.QuantWeights (quant.load_transform), and a tied LM head quantizes a copy of the embedding as loaded
        (in the model's dtype)."""
        self.config = config
        embed = take(state, "model.embed_tokens.weight")  # [vocab, hidden]; a GGUF file's may stay quantized
        self.embed = quant.pack(embed) if isinstance(embed, quant.QuantWeight) else embed  # or given packed
        self.final_norm = take(state, "model.norm.weight")
        # a kept table has no float dtype: the norm's is the model's (bf16, or fp32 on the fp32 quantized kernel)
        self.dtype = self.final_norm.dtype if isinstance(self.embed, quant.PackedQuant) else self.embed.dtype
        self.layers = [_layer_weights(config, state, i, self.dtype) for i in range(config.num_layers)]
        lm_head = state.pop("lm_head.weight", None)
        tied = lm_head is None
        if tied:
            if not config.tie_word_embeddings:
                raise ValueError("checkpoint is missing weight 'lm_head.weight' "
                                 "(and tie_word_embeddings is false)")
            lm_head = self.embed  # a quantized table is the head as it is
            if (quantization is not None and isinstance(lm_head, torch.Tensor)
                    and quant.quantizable(lm_head.shape, quantization)):
                lm_head = quant.quantize(lm_head, quantization)
        # hidden -> vocab; a tied head packs (or quantizes) a copy: the lookups keep the table
        self.lm_head = Linear(quant.linear_weight(lm_head, self.dtype), None)
        if tied and self.lm_head.is_packed and self.lm_head.quant is None:
            # The packed layout streams the head faster than the plain table at every row count, and the head is a
            # decode step's largest matmul: worth the table's size once (bench/results/decode_floor_L.md's head table).
            logger.info("tied LM head: a packed copy of the embedding (%.0f MB), faster than reading the shared "
                        "table in every decode step", lm_head.numel() * lm_head.element_size() / 2**20)
        leftover = [k for k in state if not k.endswith("rotary_emb.inv_freq")]
        if leftover:
            logger.warning("ignoring %d unused checkpoint tensor(s), e.g. %s", len(leftover), leftover[0])
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, device)
        self.sm_scale = config.head_dim ** -0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def quantized_weights(self) -> list[quant.PackedQuant]:
        """The packed quantized weights its linears multiply, each once (a tied head's is the table's)."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        found = {id(w): w for lin in (*linears, self.lm_head) for w in quant.packed_parts(lin.quant)}
        return list(found.values())

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, absolute
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [num_layers, num_slots, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [num_tokens, hidden] final hidden states before the last norm
        hidden = self.embed_rows(input_ids)  # [num_tokens, hidden], a fresh tensor: the residual stream, in place
        fast = pointwise.usable(hidden)  # the elementwise steps as native calls (kernels/pointwise.py)
        # per token, per rotary pair: (cos, sin) for the native calls, else what apply_rotary takes
        rotation = (self.rotary.cos_sin if fast else self.rotary.rotation)(positions, hidden.dtype)
        delta = None  # what the last block adds to the residual stream, added by the next norm
        for layer_idx, layer in enumerate(self.layers):
            x = self._add_norm(hidden, delta, layer.input_norm, fast)
            delta = self._attention(x, layer, rotation, meta, k_cache[layer_idx], v_cache[layer_idx], backend, fast)
            x = self._add_norm(hidden, delta, layer.post_norm, fast)
            gate_up = layer.gate_up(x)
            delta = layer.down(pointwise.silu_and_mul(gate_up) if fast else silu_and_mul(gate_up))
        return hidden if delta is None else hidden.add_(delta)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  fast: bool) -> torch.Tensor:
        """hidden += delta in place, then its RMSNorm (a new tensor)."""
        eps = self.config.rms_norm_eps
        if fast and weight.dtype == hidden.dtype:
            return pointwise.add_rms_norm(hidden, None if delta is None else delta.contiguous(), weight, eps)
        if delta is not None:
            hidden.add_(delta)
        return rms_norm(hidden, weight, eps)

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows of `input_ids` (a quantized table dequantizes only those)."""
        if isinstance(self.embed, quant.PackedQuant):
            return self.embed.lookup(input_ids, self.dtype)
        return F.embedding(input_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] (pre-norm) -> logits [num_rows, vocab] in float32."""
        x = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(x).float()

    def _attention(self, x, layer: LayerWeights, rotation, meta, k_cache, v_cache, backend, fast) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        qkv = layer.qkv(x).contiguous()  # [num_tokens, q_size + 2 * kv_size]
        if fast and layer.q_norm is None:  # q and k rotated in place, in one call
            pointwise.rotary_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, *rotation)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        if not fast:
            q = apply_rotary(q, rotation)  # [num_tokens, num_heads, head_dim]
            k = apply_rotary(k, rotation)  # [num_tokens, num_kv_heads, head_dim]
        elif layer.q_norm is not None:  # the norms' outputs are fresh contiguous tensors
            pointwise.rotary_(q.view(num_tokens, -1), cfg.num_heads, cfg.head_dim, *rotation)
            pointwise.rotary_(k.view(num_tokens, -1), cfg.num_kv_heads, cfg.head_dim, *rotation)
        out = backend.forward(q, k, v.contiguous(), k_cache, v_cache, meta, self.sm_scale,
                              layer.sliding_window)  # [num_tokens, num_heads, head_dim]
        return layer.o(out.reshape(num_tokens, self.q_size))


def _layer_weights(config: ModelConfig, state: dict[str, torch.Tensor], idx: int, dtype: torch.dtype) -> LayerWeights:
    """Layer idx's weights; a quantized weight that does not pack is dequantized to `dtype`."""
    attn = f"model.layers.{idx}.self_attn."
    mlp = f"model.layers.{idx}.mlp."

    def qk(name: str, required: bool = True) -> torch.Tensor | None:
        """A q / k tensor with its head dims in rotary-pair order (layers.interleave_rotary_pairs)."""
        t = take_optional(state, attn + name, required)
        return None if t is None else interleave_rotary_pairs(t, config.head_dim)

    q_w, k_w, v_w = qk("q_proj.weight"), qk("k_proj.weight"), take(state, attn + "v_proj.weight")

    def linear(weight, bias: torch.Tensor | None) -> Linear:
        return Linear(quant.linear_weight(weight, dtype), bias)

    qkv_b = None
    if config.qkv_bias:
        qkv_b = torch.cat([qk("q_proj.bias"), qk("k_proj.bias"), take(state, attn + "v_proj.bias")])
    return LayerWeights(
        input_norm=take(state, f"model.layers.{idx}.input_layernorm.weight"),
        qkv=linear(quant.cat_rows([q_w, k_w, v_w]), qkv_b),
        o=linear(take(state, attn + "o_proj.weight"), take_optional(state, attn + "o_proj.bias", config.o_bias)),
        q_norm=qk("q_norm.weight", config.qk_norm),
        k_norm=qk("k_norm.weight", config.qk_norm),
        post_norm=take(state, f"model.layers.{idx}.post_attention_layernorm.weight"),
        gate_up=linear(quant.cat_rows([take(state, mlp + "gate_proj.weight"), take(state, mlp + "up_proj.weight")]),
                       _gate_up_bias(config, state, mlp)),
        down=linear(take(state, mlp + "down_proj.weight"),
                    take_optional(state, mlp + "down_proj.bias", config.mlp_bias)),
        sliding_window=config.layer_sliding_windows[idx],
    )


def _gate_up_bias(config: ModelConfig, state: dict[str, torch.Tensor], mlp: str) -> torch.Tensor | None:
    if not config.mlp_bias:
        return None
    return torch.cat([take(state, mlp + "gate_proj.bias"), take(state, mlp + "up_proj.bias")])
