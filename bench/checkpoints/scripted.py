"""Scripted checkpoints (ARCHITECTURE §13): a real 2-layer HF Llama whose hand-set weights make it emit fixed texts.

build_scripted_checkpoint(dir, {"weather": '<tool_call>{"name": ...}</tool_call>', "poem": "世界🚀 STOP more"})
gives a model that, greedily, answers any prompt containing the trigger token "weather" (or " weather") with
exactly the tokens of its script followed by <|im_end|> (EOS), and answers a prompt without any trigger with EOS.

How (a backoff 3-gram model written into transformer weights; every hidden vector is a sum of unit "slots"):
    embedding   token -> const + CUR[token]            (one slot per trigger or script token; others: CUR[other])
    layer 0     heads 0..n-1: previous-token heads (RoPE scores peak at distance 1) copy CUR -> P1
                head n: trigger head (near-zero rotary frequency, keys only on trigger tokens) writes T[chain]
    layer 1     previous-token heads copy P1 -> P2 (the token two back); MLP: one SwiGLU unit per script position,
                firing iff T[chain] and CUR/P1/P2 match (1 to 4 conditions), adds 10**conditions to OUT[successor]
    lm_head     reads OUT; <|im_end|> also reads const with weight 1, so it wins when no unit fires.
A longer match outweighs all shorter ones together, so the script continues from any of its positions, and after
EOS (with ignore_eos) it starts over. Restrictions, checked with a clear ValueError: each trigger is one token;
no script contains another chain's trigger token; within a script, three consecutive tokens determine the next one;
at most 64 chains. Not checked: the prompt's last token must not be the script's first token, and a prompt must
hold the triggers of one chain only (two different triggers cancel out, and the model answers with EOS) -- unless
one of them is a *priority* trigger: its keys score 3x higher in the trigger head, so it outweighs every ordinary
trigger anywhere in the prompt. The agent round trip uses that: "weather" answers with a tool call, and once the
prompt holds the tool's result (the template's `<tool_response>` token, a priority trigger) the model answers with
its final message instead of calling the tool again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ..demo_kit.corpus import TRIGGER_WORDS
from ..demo_kit.tokenizer import build_tokenizer, special_token_ids, tokenizer_json, write_generation_config

HEAD_DIM = 64
ROPE_THETA = 10000.0
_PREV_MARGIN = 25.0  # score gap (nats) between the previous token and any other one
_TRIGGER_SCORE = 40.0  # trigger-head score of a trigger token at the largest distance
_GATE = 40.0  # SwiGLU gate slope: a matching unit sees +G/2, a unit one condition short sees -G/2
_PRIORITY = 10.0  # a unit with n conditions adds _PRIORITY**n to its successor's logit
# A priority trigger's score: >= 3 * 40 at the largest distance, against <= 40 / cos(1) ~ 74 for an ordinary one at
# distance 0; the 46-nat gap leaves the ordinary trigger e^-46 of the head's attention.
_PRIORITY_TRIGGER_GAIN = 3.0


@dataclass(frozen=True)
class _Chain:
    trigger: str
    trigger_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # the script, without the final EOS
    priority: bool = False


def build_scripted_checkpoint(
    out_dir: str,
    chains: Mapping[str, str | Sequence[int] | Sequence[str]],
    *,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    priority: Sequence[str] = (),
    verify: bool = True,
) -> str:
    """Write a Llama checkpoint (with the demo tokenizer) that emits chains[trigger] + EOS after a trigger.

    A chain's value is text (tokenized as tokenizer.encode would, no special tokens added), explicit token ids
    (e.g. to force a particular split of a multi-byte character), or a list of text pieces tokenized one by one
    (e.g. to cut a `</think>` tag into several tokens). `priority` names triggers that win over every
    other trigger when both are in the prompt (see the module docstring). verify=True teacher-forces every script through
    the built model and raises RuntimeError if the weights do not reproduce it. Returns out_dir.
    """
    from tokenizers import Tokenizer
    import transformers

    tok = Tokenizer.from_str(tokenizer_json(vocab_size))
    eos_id = special_token_ids(vocab_size)["<|im_end|>"]
    unknown = sorted(set(priority) - set(chains))
    if unknown:
        raise ValueError(f"priority names triggers without a script: {unknown}")
    parsed = [_parse_chain(tok, trigger, value, vocab_size, trigger in priority) for trigger, value in chains.items()]
    _check_chains(tok, parsed)
    layout = _Layout(parsed, eos_id)
    _check_positions(max_position_embeddings)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=layout.hidden_size, intermediate_size=layout.num_units,
        num_hidden_layers=2, num_attention_heads=layout.num_heads, num_key_value_heads=layout.num_heads,
        head_dim=HEAD_DIM, max_position_embeddings=max_position_embeddings, rope_theta=ROPE_THETA,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=special_token_ids(vocab_size)["<|endoftext|>"],
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)  # RMSNorm weights stay 1
        _set_weights(model, layout, vocab_size)
    if verify:
        _verify(model, parsed, eos_id, vocab_size, layout)
    model.save_pretrained(out_dir)
    write_generation_config(out_dir, vocab_size)
    build_tokenizer(out_dir, vocab_size)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------


def _parse_chain(tok, trigger: str, value: str | Sequence[int] | Sequence[str], vocab_size: int, priority: bool) -> _Chain:
    forms = {trigger, " " + trigger.lstrip(" ")}
    trigger_ids = sorted({ids[0] for ids in (tok.encode(f, add_special_tokens=False).ids for f in forms) if len(ids) == 1})
    if not trigger_ids:
        pieces = tok.encode(trigger, add_special_tokens=False).tokens
        raise ValueError(
            f"trigger {trigger!r} must be a single token of the demo vocabulary (alone or after a space), but it "
            f"splits into {pieces}; pick one of {', '.join(TRIGGER_WORDS)}"
        )
    output_ids = _script_ids(tok, value)
    if not output_ids:
        raise ValueError(f"the script of trigger {trigger!r} is empty")
    bad = [i for i in output_ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"the script of trigger {trigger!r} has token ids outside [0, {vocab_size}): {bad}")
    return _Chain(trigger, tuple(trigger_ids), tuple(output_ids), priority)


def _script_ids(tok, value: str | Sequence[int] | Sequence[str]) -> list[int]:
    """A script's ids: text tokenized as a whole, explicit ids, or text pieces each tokenized on its own (so a
    tag such as `</think>` can be cut into the tokens a test wants, wherever the tokenizer would merge them)."""
    if isinstance(value, str):
        return tok.encode(value, add_special_tokens=False).ids
    if value and all(isinstance(v, str) for v in value):
        return [i for piece in value for i in tok.encode(piece, add_special_tokens=False).ids]
    return [int(i) for i in value]


def _check_chains(tok, chains: list[_Chain]) -> None:
    if len(chains) > HEAD_DIM:
        raise ValueError(f"at most {HEAD_DIM} chains are supported, got {len(chains)}")
    owner: dict[int, str] = {}
    for chain in chains:
        for tid in chain.trigger_ids:
            if tid in owner:
                raise ValueError(f"triggers {owner[tid]!r} and {chain.trigger!r} share the token {tok.id_to_token(tid)!r}")
            owner[tid] = chain.trigger
    for chain in chains:
        clash = sorted({owner[t] for t in chain.output_ids if t in owner and owner[t] != chain.trigger})
        if clash:
            raise ValueError(f"the script of {chain.trigger!r} contains the trigger token(s) of {clash}; rephrase it")
        successor: dict[tuple[int, ...], int] = {}
        script = chain.output_ids + (-1,)  # -1 stands for EOS
        for k in range(2, len(chain.output_ids)):
            context, nxt = script[k - 2 : k + 1], script[k + 1]
            if successor.setdefault(context, nxt) != nxt:
                text = "".join(tok.decode([t]) for t in context)
                raise ValueError(
                    f"in the script of {chain.trigger!r} the three tokens {text!r} are followed by different tokens; "
                    "a scripted model needs three consecutive tokens to determine the next one; rephrase the script"
                )


def _check_positions(max_position_embeddings: int) -> None:
    lowest = ROPE_THETA ** (-(HEAD_DIM - 2) / HEAD_DIM)
    if max_position_embeddings * lowest > 1.0:
        raise ValueError(f"max_position_embeddings must be at most {int(1.0 / lowest)} for a scripted checkpoint")


class _Layout:
    """Where each slot of the hidden vector lives, and the units of the layer-1 MLP."""

    def __init__(self, chains: list[_Chain], eos_id: int) -> None:
        self.chains = chains
        self.eos_id = eos_id
        out_tokens = sorted({t for c in chains for t in c.output_ids})
        trigger_tokens = sorted({t for c in chains for t in c.trigger_ids})
        # CUR slots: 0 = any other token, then one per trigger or script token.
        relevant = sorted(set(out_tokens) | set(trigger_tokens))
        self.slot_of = {tid: 1 + i for i, tid in enumerate(relevant)}
        self.num_slots = 1 + len(relevant)
        self.trigger_slots = [(self.slot_of[t], c_idx, c.priority) for c_idx, c in enumerate(chains)
                              for t in c.trigger_ids]
        self.num_prev_heads = math.ceil(self.num_slots / HEAD_DIM)
        # Heads beyond the previous-token heads and the trigger head stay zero; a power of two divides the hidden
        # size (a multiple of 64), which transformers requires.
        self.num_heads = 1 << self.num_prev_heads.bit_length()
        self.cur = 1  # hidden index of CUR slot 0; const is hidden index 0
        self.p1 = self.cur + self.num_slots
        self.p2 = self.p1 + self.num_slots
        self.t = self.p2 + self.num_slots
        self.succ_tokens = sorted(set(out_tokens) | {eos_id})
        self.out = self.t + len(chains)
        self.out_idx = {tid: self.out + i for i, tid in enumerate(self.succ_tokens)}
        used = self.out + len(self.succ_tokens)
        self.hidden_size = -(-used // 64) * 64
        self.units = self._units()
        self.num_units = max(8, -(-len(self.units) // 8) * 8)

    def _units(self) -> list[tuple[list[int], int]]:
        """(hidden indices that must all be ~1, successor token id) for each script position."""
        units: list[tuple[list[int], int]] = []
        seen: set[tuple] = set()
        for c_idx, chain in enumerate(self.chains):
            script = chain.output_ids + (self.eos_id,)
            units.append(([self.t + c_idx], script[0]))  # start: trigger seen, whatever the current token
            for k in range(1, len(script)):
                need = [self.t + c_idx, self.cur + self.slot_of[script[k - 1]]]
                if k >= 2:
                    need.append(self.p1 + self.slot_of[script[k - 2]])
                if k >= 3:
                    need.append(self.p2 + self.slot_of[script[k - 3]])
                key = (tuple(need), script[k])
                if key not in seen:  # a repeated context (same successor) must not count twice
                    seen.add(key)
                    units.append((need, script[k]))
        return units


def _set_weights(model, layout: _Layout, vocab_size: int) -> None:
    H, D = layout.hidden_size, HEAD_DIM
    emb = model.model.embed_tokens.weight  # [vocab, hidden]
    emb[:, 0] = 1.0
    emb[:, layout.cur] = 1.0  # CUR[other]
    for tid, slot in layout.slot_of.items():
        emb[tid, layout.cur] = 0.0
        emb[tid, layout.cur + slot] = 1.0
    # RMSNorm turns h into h * sqrt(H) / |h|; |h|^2 counts the unit slots present (trigger assumed seen).
    r0, r1, r_mlp = math.sqrt(H / 2), math.sqrt(H / 4), math.sqrt(H / 5)
    theta = ROPE_THETA ** (-np.arange(0, D, 2) / D)  # [D/2]
    for layer_idx, (src, dst, r) in enumerate([(layout.cur, layout.p1, r0), (layout.p1, layout.p2, r1)]):
        attn = model.model.layers[layer_idx].self_attn
        for h in range(layout.num_prev_heads):
            _previous_token_head(attn, h, theta, r, src, dst, layout.num_slots)
    _trigger_head(model.model.layers[0].self_attn, layout, r0)
    _mlp_units(model.model.layers[1].mlp, layout, r_mlp)
    lm_head = model.lm_head.weight  # [vocab, hidden]
    for tid, idx in layout.out_idx.items():
        lm_head[tid, idx] = 1.0
    lm_head[layout.eos_id, 0] = 1.0


def _previous_token_head(attn, h: int, theta: np.ndarray, r: float, src: int, dst: int, num_slots: int) -> None:
    """Scores c * sum_m cos((i - j - 1) * theta_m): largest at j = i - 1; value copies slots [h*D, (h+1)*D)."""
    D = HEAD_DIM
    dist = np.arange(0, 8192)
    gap = (1 - np.cos(np.outer(dist - 1, theta))).sum(axis=1)  # [8192]
    gap[1] = np.inf
    amp = math.sqrt(_PREV_MARGIN / gap.min() * math.sqrt(D))  # q.k / sqrt(D) = amp^2 / sqrt(D) * sum cos
    rows = slice(h * D, h * D + D // 2)
    attn.q_proj.weight[rows, 0] = amp / r
    attn.k_proj.weight[rows, 0] = torch.tensor(amp * np.cos(theta) / r, dtype=torch.float32)
    attn.k_proj.weight[h * D + D // 2 : (h + 1) * D, 0] = torch.tensor(amp * np.sin(theta) / r, dtype=torch.float32)
    for j in range(D):
        slot = h * D + j
        if slot < num_slots:
            attn.v_proj.weight[h * D + j, src + slot] = 1.0 / r
            attn.o_proj.weight[dst + slot, h * D + j] = 1.0


def _trigger_head(attn, layout: _Layout, r: float) -> None:
    """Keys only on trigger tokens, on the slowest rotary pair (nearly position-free); value = the chain index.
    A priority trigger's key is _PRIORITY_TRIGGER_GAIN times longer, so the head attends to it alone."""
    D, h = HEAD_DIM, layout.num_prev_heads
    m = D // 2 - 1
    amp = math.sqrt(_TRIGGER_SCORE / math.cos(1.0) * math.sqrt(D))  # score >= 40 up to the largest distance
    attn.q_proj.weight[h * D + m, 0] = amp / r
    for slot, c_idx, priority in layout.trigger_slots:
        gain = _PRIORITY_TRIGGER_GAIN if priority else 1.0
        attn.k_proj.weight[h * D + m, layout.cur + slot] = gain * amp / r
        attn.v_proj.weight[h * D + c_idx, layout.cur + slot] = 1.0 / r
    for c_idx in range(len(layout.chains)):
        attn.o_proj.weight[layout.t + c_idx, h * D + c_idx] = 1.0


def _mlp_units(mlp, layout: _Layout, r: float) -> None:
    for u, (need, succ) in enumerate(layout.units):
        for idx in need:
            mlp.gate_proj.weight[u, idx] = _GATE / r
        mlp.gate_proj.weight[u, 0] = -(len(need) - 0.5) * _GATE / r
        mlp.up_proj.weight[u, 0] = 1.0 / r
        mlp.down_proj.weight[layout.out_idx[succ], u] = _PRIORITY ** len(need) / (0.5 * _GATE)


def _verify(model, chains: list[_Chain], eos_id: int, vocab_size: int, layout: _Layout) -> None:
    filler = next(t for t in range(vocab_size) if t not in layout.slot_of)
    for chain in chains:
        for trigger_id in chain.trigger_ids:
            prompt = [filler, trigger_id, filler]
            ids = torch.tensor([prompt + list(chain.output_ids)])  # [1, seq]
            with torch.no_grad():
                predicted = model(ids).logits[0, len(prompt) - 1 :].argmax(-1).tolist()
            if predicted != list(chain.output_ids) + [eos_id]:
                raise RuntimeError(f"scripted weights do not reproduce the script of {chain.trigger!r}: {predicted}")
    ordinary = next((c for c in chains if not c.priority), None)
    for chain in chains:
        if chain.priority and ordinary is not None:  # the priority trigger wins from before or after the other
            for prompt in ([filler, ordinary.trigger_ids[0], chain.trigger_ids[0], filler],
                           [filler, chain.trigger_ids[0], ordinary.trigger_ids[0], filler]):
                with torch.no_grad():
                    first = model(torch.tensor([prompt])).logits[0, -1].argmax().item()
                if first != chain.output_ids[0]:
                    raise RuntimeError(f"the priority trigger {chain.trigger!r} does not win over {ordinary.trigger!r}")
    with torch.no_grad():
        if model(torch.tensor([[filler] * 3])).logits[0, -1].argmax().item() != eos_id:
            raise RuntimeError("scripted weights do not answer EOS to a prompt without a trigger")
