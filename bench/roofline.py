"""A measured fp32 matmul roofline at a Llama model's linear-layer shapes, and the linear FLOPs of a run.

Linear FLOPs of a run = 2 * P_linear * computed tokens, where P_linear = the decoder layers' linear
weights (q, k, v, o, gate, up, down; embeddings and lm_head excluded: only sampled positions need
logits) and computed tokens = prompt tokens - cached tokens + output tokens. The roofline is the best
GFLOP/s of `torch.matmul` and of the engine's packed oneDNN linear over one layer's shapes ([T, in] @
[in, out]) at T = 512 and 4096 tokens and the bench's thread count: total FLOPs / total time, so the mix
is the model's own.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

FORMULA = ("linear FLOPs = 2 * P_linear * (prompt tokens - cached tokens + output tokens); P_linear = "
           "q, k, v, o, gate, up, down weights of all layers (no embeddings, no lm_head)")


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # element sizes of the dtypes the benches run


def load_config(model_path: str) -> dict[str, Any]:
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def layer_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linear projections."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    q_out, kv_out = heads * head_dim(config), kv_heads * head_dim(config)
    return [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden), (hidden, inter), (hidden, inter),
            (inter, hidden)]


def linear_params(config: dict[str, Any]) -> int:
    return config["num_hidden_layers"] * sum(k * n for k, n in layer_shapes(config))


def linear_flops(config: dict[str, Any], computed_tokens: int) -> float:
    return 2.0 * linear_params(config) * computed_tokens


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` inside, restored after."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def passes_per_second(run_pass: Callable[[], None], min_time_s: float) -> tuple[int, float]:
    """(passes, elapsed seconds) of repeating run_pass for at least min_time_s and 3 passes, after one
    untimed warm-up pass (first-call allocation, thread start-up)."""
    run_pass()
    passes, start = 0, time.perf_counter()
    while passes < 3 or time.perf_counter() - start < min_time_s:
        run_pass()
        passes += 1
    return passes, time.perf_counter() - start


def measure_roofline(config: dict[str, Any], threads: int, num_tokens: int | tuple[int, ...] = (512, 4096),
                     min_time_s: float = 0.5, dtype: str = "float32") -> dict[str, Any]:
    """GFLOP/s of matmuls in `dtype` (float32 or bfloat16) at the layer's shapes with `threads` intra-op threads (restored after): the best of
    torch.matmul and the engine's own linear (oneDNN's packed weights, kernels.layers.Linear) at each token count
    (the peer benches' prefill chunks hold 4096 tokens), so that no engine's linears should exceed it."""
    import torch

    from ..kernels.layers import Linear

    shapes = layer_shapes(config)
    runs = []
    with torch_threads(threads):
        for tokens in (num_tokens,) if isinstance(num_tokens, int) else num_tokens:
            flops_per_pass = sum(2.0 * tokens * k * n for k, n in shapes)
            xs = [torch.randn(tokens, k, dtype=getattr(torch, dtype)) for k, _ in shapes]
            weights = [torch.randn(n, k, dtype=getattr(torch, dtype)) for k, n in shapes]
            linears = [Linear(w, None) for w in weights]
            kinds = {"torch.matmul": lambda: [torch.matmul(x, w.t()) for x, w in zip(xs, weights)],
                     "packed linear": lambda: [lin(x) for x, lin in zip(xs, linears)]}
            for method, run_pass in kinds.items():
                passes, elapsed = passes_per_second(run_pass, min_time_s)
                runs.append({"method": method, "num_tokens": tokens, "passes": passes,
                             "gflops": flops_per_pass * passes / elapsed / 1e9})
    best = max(runs, key=lambda r: r["gflops"])
    return {**best, "threads": threads, "dtype": dtype, "runs": runs, "shapes": [list(s) for s in shapes],
            "linear_params": linear_params(config)}


def measure_stream_gbs(num_floats: int, threads: int, min_time_s: float = 0.5) -> float:
    """GB/s of torch.sum over an fp32 tensor of num_floats (read once per pass)."""
    import torch

    data = torch.randn(num_floats)
    with torch_threads(threads):
        passes, elapsed = passes_per_second(data.sum, min_time_s)
    return 4.0 * num_floats * passes / elapsed / 1e9


def kv_bytes_per_token(config: dict[str, Any], elem: int) -> int:
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return 2 * elem * config["num_hidden_layers"] * kv_heads * head_dim(config)


def decode_step_bytes(config: dict[str, Any], rounds: Sequence[Sequence[tuple]], elem: int) -> dict[str, float]:
    """Bytes one decode step reads, averaged over a workload's decode steps (each round's requests decoding
    together, one output token a step): the linears and LM head, and the K/V of the running requests'
    contexts, read once per request (`kv_per_request`) or once per distinct prefix-tree token
    (`kv_prefix_once`: what a reader of shared prefixes needs). Rounds as bench.harness.stand_in_rounds gives."""
    weights = elem * (linear_params(config) + config["vocab_size"] * config["hidden_size"])
    per_token = kv_bytes_per_token(config, elem)
    steps = per_request = once = 0
    for items in rounds:
        distinct: dict[int, int] = {}  # running count -> tree size of their prompts (the set only shrinks)
        for step in range(max((len(out) for _, out, _ in items), default=0)):
            running = [prompt for prompt, out, _ in items if len(out) > step]
            if len(running) not in distinct:
                distinct[len(running)] = _trie_size(running)
            steps += 1
            per_request += sum(len(p) + step for p in running)
            once += distinct[len(running)] + step * len(running)  # outputs are each request's own
    if not steps:
        return {"weights": float(weights), "kv_per_request": 0.0, "kv_prefix_once": 0.0, "decode_steps": 0}
    return {"weights": float(weights), "kv_per_request": per_token * per_request / steps,
            "kv_prefix_once": per_token * once / steps, "decode_steps": steps}


def _trie_size(prompts: Iterable[Sequence[int]]) -> int:
    """Distinct tokens of the prefix tree of `prompts` (shared prefixes counted once)."""
    root: dict[int, dict] = {}
    size = 0
    for prompt in prompts:
        node = root
        for tok in prompt:
            child = node.get(tok)
            if child is None:
                child = node[tok] = {}
                size += 1
            node = child
    return size
