"""How much a quantized KV cache moves K, V and attention: int8 (the pool's scheme, kernels/attention/kv_int8.py)
against fp8 e4m3 at the same cost, on the K and V a model really produces.

Both schemes scale each (token, kv head) row by one float32 scale: int8 s = max|x| / 127, x' = s round(x / s);
fp8 e4m3 s = max|x| / 448 (e4m3's largest finite value), x' = s fp8(x / s) (torch.float8_e4m3fn, round to nearest
even). Both take head_dim + 4 bytes a row. int8 has a uniform step (s / 2 off at most, whatever the element's
size); e4m3 keeps 3 mantissa bits (a relative step of 2^-4) down to 2^-6 s, then steps of 2^-9 s.

The model runs a prompt through transformers (its checkpoint dtype); its attention calls are captured: q, K (after
RoPE, as the pool stores it) and V per layer. Per layer and scheme: the relative error ||x' - x|| / ||x|| (Frobenius,
float64) of K and of V, and of the causal attention output over the quantized K and V against the same attention
(float64) over the exact ones. `reference_error`: the float64 attention over exact K and V against the model's own
output (its dtype's rounding only: the capture read the right q, K, V, scale and mask).

    python -m radixserve.bench.kv_quant_error --models demo,L --tokens 512 --out bench/results
"""
from __future__ import annotations

import statistics
import sys
from typing import Any, Sequence

import torch

from ..kernels.attention.kv_int8 import QMAX, quantize
from .harness import bench_model_path
from .output import BenchOutput, bench_parser, parse_args

SCHEMES = {"int8": float(QMAX), "fp8_e4m3": 448.0}  # the largest magnitude each code holds


def quantize_rows(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [..., d] through the scheme and back (float64), one float32 scale per row: int8 is the pool's own
    (kv_int8.quantize), fp8 e4m3 the same with max|x| / 448."""
    if scheme == "int8":
        ints, scale = quantize(x)
        return ints.double() * scale.double()[..., None]
    scale = x.float().abs().amax(-1, keepdim=True) / SCHEMES[scheme]
    unit = torch.where(scale > 0, x.float() / scale, 0.0).clamp(-SCHEMES[scheme], SCHEMES[scheme])
    return unit.to(torch.float8_e4m3fn).double() * scale.double()


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius, float64)."""
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [heads, T, d] over k, v [kv_heads, T, d] (grouped: heads / kv_heads queries a kv head), causal, float64."""
    group = q.shape[0] // k.shape[0]
    k, v = (t.double().repeat_interleave(group, 0) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    t = q.shape[1]
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def layer_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, scheme: str) -> dict[str, float]:
    """One layer's relative errors of K, V and the attention output under `scheme` (q [heads, T, d], k and v
    [kv_heads, T, d]; rows are (kv head, token))."""
    kq, vq = quantize_rows(k, scheme), quantize_rows(v, scheme)
    exact = causal_attention(q, k, v, scale)
    return {"k": relative_error(kq, k), "v": relative_error(vq, v),
            "out": relative_error(causal_attention(q, kq, vq, scale), exact)}


def capture(model_path: str, ids: list[int]) -> list[dict[str, Any]]:
    """Per layer: q [heads, T, d], k and v [kv_heads, T, d] as the model's attention received them, its scale,
    and its output [heads, T, d] (transformers, the checkpoint's dtype)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layers: list[dict[str, Any]] = []

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layers.append({"q": query[0].detach(), "k": key[0].detach(), "v": value[0].detach(),
                       "scale": float(scaling if scaling is not None else query.shape[-1] ** -0.5),
                       "out": out[0].transpose(0, 1).detach()})
        return out, weights

    AttentionInterface.register("radixserve_capture", record)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype="auto",
                                                              attn_implementation="radixserve_capture").eval()
    with torch.inference_mode():
        model(torch.tensor([ids]))
    return layers


def prompt_ids(model: str, model_path: str, tokens: int, seed: int) -> list[int]:
    """The demo model: its own kind of text (the demo corpus, bench/demo_kit/corpus.py); random weights: seeded
    random ids."""
    if model == "demo":
        from tokenizers import Tokenizer

        from .demo_kit.corpus import corpus

        ids = Tokenizer.from_file(f"{model_path}/tokenizer.json").encode(corpus()).ids
        return ids[:tokens]
    import json

    with open(f"{model_path}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (tokens,), generator=gen).tolist()


def measure(model: str, model_path: str, tokens: int, seed: int = 0) -> dict[str, Any]:
    layers = capture(model_path, prompt_ids(model, model_path, tokens, seed))
    per_layer = {s: [layer_errors(L["q"], L["k"], L["v"], L["scale"], s) for L in layers] for s in SCHEMES}
    reference = max(relative_error(causal_attention(L["q"], L["k"], L["v"], L["scale"]), L["out"]) for L in layers)
    summary = {s: {f"{x}_{stat}": f([e[x] for e in errs]) for x in ("k", "v", "out")
                   for stat, f in (("median", statistics.median), ("max", max))} for s, errs in per_layer.items()}
    first = layers[0]
    return {"model": model, "path": model_path, "tokens": tokens, "layers": len(layers),
            "dtype": str(first["k"].dtype).removeprefix("torch."), "kv_heads": first["k"].shape[0],
            "head_dim": first["k"].shape[-1], "reference_error": reference, "summary": summary,
            "per_layer": per_layer}


def markdown(report: dict[str, Any]) -> str:
    lines = ["# KV cache quantization error: int8 vs fp8 e4m3, one float32 scale per (token, kv head) row", "",
             f"`{report['command']}`", "",
             "Relative error ||x' - x|| / ||x|| (float64) of K, V and the causal attention output over the quantized "
             "K and V, median and max over layers. fp8 / int8: the ratio of the medians (above 1: fp8 is worse).", "",
             "| model (dtype, tokens) | scheme | K median / max | V median / max | attention out median / max "
             "| reference error |", "|---|---|---|---|---|---|"]
    for m in report["models"]:
        for s, e in m["summary"].items():
            lines.append(f"| {m['model']} ({m['dtype']}, {m['tokens']}) | {s} | {e['k_median']:.2e} / "
                         f"{e['k_max']:.2e} | {e['v_median']:.2e} / {e['v_max']:.2e} | {e['out_median']:.2e} / "
                         f"{e['out_max']:.2e} | {m['reference_error']:.1e} |")
        i8, f8 = m["summary"]["int8"], m["summary"]["fp8_e4m3"]
        lines.append(f"| {m['model']} | fp8 / int8 | {f8['k_median'] / i8['k_median']:.2f}x | "
                     f"{f8['v_median'] / i8['v_median']:.2f}x | {f8['out_median'] / i8['out_median']:.2f}x | |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    models = []
    for model in args.models.split(","):
        models.append(measure(model, bench_model_path(model), args.tokens, args.seed))
    report = {"bench": "kv_quant_error", "command": args.command, "models": models}
    out = BenchOutput("kv_quant_error", args.out)
    out.finish(out.write_report("kv_quant_error", report, markdown(report)))
    return report


def _parse(argv: Sequence[str] | None) -> Any:
    p = bench_parser("kv_quant_error", __doc__)
    p.add_argument("--models", default="demo,L", help="demo (the built-in trained model), a bench model (S, M, L, "
                                                       "tiny: random weights), or a checkpoint directory")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="random prompt ids (models other than demo)")
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
