"""Train the built-in demo model (kernels/demo_checkpoint/) on the synthetic corpus of bench/demo_kit/data.py, on CPU.

    python -m radixserve.bench.demo_kit.train                       # the shipped model: writes kernels/demo_checkpoint/
    python -m radixserve.bench.demo_kit.train --out DIR --steps 20  # a short run elsewhere

Deterministic for a fixed thread count (--threads, default 2, as the shipped run): a seeded model, a seeded sample
stream in a fixed order, torch.use_deterministic_algorithms, no data-loader workers. The loss sees assistant turns
(what the model is asked to write, ending in <|im_end|>) at weight 1 and every other token (prompts, tool results,
ReAct observations) at --prompt-loss-weight (0.25). Matmuls run in bf16 under CPU autocast and the decoder stack is
compiled (--no-bf16 / --no-compile: plain fp32 eager, slower, different numbers).
Writes exactly what ships: config.json, model.safetensors, generation_config.json (with max_new_tokens), the demo
tokenizer's files and eval.json (the final loss and the greedy accuracy on held-out prompts, demo_eval.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from ...kernels.demo import DEMO_CHECKPOINT_DIR
from .data import Generator
from .sample import Sample
from .tokenizer import build_tokenizer, special_token_ids, tokenizer_json

SHIPPED_DIR = DEMO_CHECKPOINT_DIR
VOCAB_SIZE = 2048
MAX_NEW_TOKENS = 256  # generation_config.json's default reply length (replies end with EOS long before)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 2600
    samples_per_step: int = 32
    tokens_per_micro_batch: int = 6144  # padded tokens per forward pass
    lr: float = 3e-3
    warmup_steps: int = 40
    weight_decay: float = 0.01
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    max_len: int = 512
    # Loss weight of every token the model is not asked to write (prompts, tool results, ReAct observations);
    # assistant tokens weigh 1 (0: assistant turns only). Prompts in the loss are what taught copying.
    prompt_loss_weight: float = 0.25
    # Speed: together 1.9x the steps in the same time (MODEL_CARD). Each changes the numbers, so each is part of
    # the run's definition. A micro-batch holds samples at most bucket_ratio times as long as its shortest
    # (0: only the token cap splits them, about 45% padding); bf16: matmuls under CPU autocast (AMX where
    # present; weights and optimizer state stay fp32); compile: torch.compile the decoder stack (under a
    # minute of compiling, then fused elementwise kernels).
    bucket_ratio: float = 1.5
    bf16: bool = True
    compile: bool = True
    # Matmul row counts are rounded up to a multiple of this (padded tokens weigh 0): oneDNN builds a bf16
    # kernel per shape, and without rounding most micro-batches paid for a build (1: no rounding).
    shape_multiple: int = 32


class Encoder:
    """Samples -> (token ids, per-token trainable flags), tokenized exactly as the server tokenizes the rendered
    chat (scheduler/tokenizer.py renders the template; the whole text is encoded at once)."""

    def __init__(self, tokenizer_dir: str) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        from ...scheduler.tokenizer import Tokenizer

        self.chat = Tokenizer(tokenizer_dir)
        self.rust = RustTokenizer.from_str(tokenizer_json(VOCAB_SIZE))
        self.eot = "<|endoftext|>"

    def encode(self, sample: Sample) -> tuple[list[int], list[bool]]:
        if sample.text is not None:
            text, spans = sample.text + self.eot, [(0, len(sample.text) + len(self.eot))]
        else:
            text, spans = self._chat_spans(sample)
        enc = self.rust.encode(text, add_special_tokens=False)
        flags = [any(lo <= start < hi for lo, hi in spans) for start, _ in enc.offsets]
        return enc.ids, flags

    def _chat_spans(self, sample: Sample) -> tuple[str, list[tuple[int, int]]]:
        render = self.chat.render_chat
        spans: list[tuple[int, int]] = []
        turn = 0
        for k, message in enumerate(sample.messages):
            if message["role"] != "assistant":
                continue
            prefix = render(sample.messages[:k], sample.tools, add_generation_prompt=True)
            upto = render(sample.messages[:k + 1], sample.tools, add_generation_prompt=False)
            if not upto.startswith(prefix) or not upto.endswith("<|im_end|>\n"):
                raise RuntimeError("the chat template does not extend the prompt with the assistant turn")
            pieces = sample.pieces[turn]
            turn += 1
            if pieces is None:
                spans.append((len(prefix), len(upto) - 1))  # the turn and its <|im_end|>, not the newline after
                continue
            at = len(prefix)
            for text, trainable in pieces:
                if trainable:
                    spans.append((at, at + len(text)))
                at += len(text)
            spans.append((at, len(upto) - 1))  # <|im_end|>
        full = render(sample.messages, sample.tools, add_generation_prompt=False)
        return full, spans


def batches(encoder: Encoder, cfg: TrainConfig) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step: micro-batches (input ids, labels) of samples sorted by length (little padding)."""
    gen = Generator(cfg.seed)
    pad = special_token_ids(VOCAB_SIZE)["<|endoftext|>"]
    while True:
        encoded = [encoder.encode(gen.sample()) for _ in range(cfg.samples_per_step)]
        encoded = sorted((e for e in encoded if len(e[0]) <= cfg.max_len), key=lambda e: len(e[0]))
        micro, group = [], []
        for e in encoded:
            if group and _starts_new(group, len(e[0]), cfg):
                micro.append(_collate(group, pad, cfg))
                group = []
            group.append(e)
        micro.append(_collate(group, pad, cfg))
        yield micro


def _starts_new(group: list, length: int, cfg: TrainConfig) -> bool:
    """Whether a sample of `length` tokens (the longest so far) opens a new micro-batch after `group`."""
    if (len(group) + 1) * length > cfg.tokens_per_micro_batch:
        return True
    return bool(cfg.bucket_ratio) and length > cfg.bucket_ratio * len(group[0][0])


def _collate(group: list[tuple[list[int], list[bool]]], pad: int,
             cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, per-token loss weights): 1 on assistant tokens, prompt_loss_weight elsewhere, 0 on padding."""
    width = _round_up(max(len(ids) for ids, _ in group), cfg.shape_multiple)
    ids = torch.full((len(group), width), pad, dtype=torch.long)
    labels = torch.full((len(group), width), -100, dtype=torch.long)
    weights = torch.zeros((len(group), width))
    for row, (toks, flags) in enumerate(group):
        ids[row, :len(toks)] = torch.tensor(toks)
        labels[row, :len(toks)] = torch.tensor(toks)
        weights[row, :len(toks)] = torch.tensor([1.0 if f else cfg.prompt_loss_weight for f in flags])
    return ids, labels, weights


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def make_model(cfg: TrainConfig):
    import transformers

    ids = special_token_ids(VOCAB_SIZE)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(cfg.seed)
    return transformers.LlamaForCausalLM(config)


def train(cfg: TrainConfig, out_dir: str, threads: int = 1, log=print) -> dict:
    """Train and write the checkpoint to out_dir; returns the training summary (also in eval.json)."""
    torch.set_num_threads(threads)
    # Room for every bf16 kernel shape a run builds (the default 1024 would evict and rebuild them); oneDNN reads
    # it at its first use in the process, which for the CLI is here.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16384")
    torch.use_deterministic_algorithms(True)
    model = make_model(cfg)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    decoder = torch.compile(model.model, dynamic=True) if cfg.compile else model.model
    with tempfile.TemporaryDirectory() as tok_dir:
        build_tokenizer(tok_dir, VOCAB_SIZE)
        stream = batches(Encoder(tok_dir), cfg)
        start, losses = time.time(), []
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = _lr(cfg, step)
            micro = next(stream)
            count = sum(float(weights[:, 1:].sum()) for _, _, weights in micro)
            total = 0.0
            for ids, labels, weights in micro:
                loss = _micro_loss(model, decoder, ids, labels, weights, count, cfg)
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
            if step % 10 == 0 or step == cfg.steps - 1:
                log(f"step {step:5d}  loss {total:.4f}  lr {_lr(cfg, step):.2e}  {time.time() - start:7.1f} s")
    model.eval()
    summary = {"config": asdict(cfg), "threads": threads, "train_seconds": round(time.time() - start, 1),
               "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4)}
    save(model, out_dir)
    return summary


def _micro_loss(model, decoder, ids, labels, weights, count: float, cfg: TrainConfig) -> torch.Tensor:
    """One micro-batch's share of the step's loss. The output layer runs only where the loss looks (no padding;
    with prompt_loss_weight 0, assistant tokens only), on a row count rounded to cfg.shape_multiple."""
    target, weight = labels[:, 1:], weights[:, 1:]
    keep = weight > 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        hidden = decoder(input_ids=ids).last_hidden_state[:, :-1][keep]
        rows = hidden.shape[0]
        padded = torch.nn.functional.pad(hidden, (0, 0, 0, _round_up(rows, cfg.shape_multiple) - rows))
        logits = model.lm_head(padded)[:rows].float()
    ce = torch.nn.functional.cross_entropy(logits, target[keep], reduction="none")
    return (ce * weight[keep]).sum() / count


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def save(model, out_dir: str) -> None:
    """The checkpoint directory as it ships (float32 safetensors, tied embeddings: one copy)."""
    from .tokenizer import write_generation_config

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    write_generation_config(out_dir, VOCAB_SIZE)
    path = os.path.join(out_dir, "generation_config.json")
    with open(path, encoding="utf-8") as f:
        body = json.load(f)
    body["max_new_tokens"] = MAX_NEW_TOKENS
    with open(path, "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")
    build_tokenizer(out_dir, VOCAB_SIZE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=SHIPPED_DIR, help="checkpoint directory to write (default: the shipped one)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (the result depends on it; the shipped run used 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-loss-weight", type=float, default=TrainConfig.prompt_loss_weight,
                        help="loss weight of the tokens the model does not write (0: assistant turns only)")
    parser.add_argument("--bucket-ratio", type=float, default=TrainConfig.bucket_ratio,
                        help="longest / shortest sample in a micro-batch (0: no limit)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=TrainConfig.bf16,
                        help="matmuls in bf16 under CPU autocast")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=TrainConfig.compile,
                        help="torch.compile the decoder stack")
    parser.add_argument("--shape-multiple", type=int, default=TrainConfig.shape_multiple,
                        help="round matmul row counts up to this multiple (fewer distinct bf16 kernels)")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    args = parser.parse_args(argv)
    if args.compile and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        parser.error("--compile (the default) needs a C++ compiler for torch.compile; install one, or pass "
                     "--no-compile (slower, and a different model than the shipped one)")
    cfg = TrainConfig(seed=args.seed, steps=args.steps, prompt_loss_weight=args.prompt_loss_weight,
                      bucket_ratio=args.bucket_ratio, bf16=args.bf16, compile=args.compile,
                      shape_multiple=args.shape_multiple)
    summary = train(cfg, args.out, args.threads, log=lambda line: print(line, flush=True))
    if not args.no_eval:
        from .eval_cases import evaluate

        summary["heldout"] = evaluate(args.out)
    with open(os.path.join(args.out, "eval.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
