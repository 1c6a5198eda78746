"""Structured-generation bench: what a JSON schema costs against unconstrained decoding, and what jump-forward
saves on a schema with long fixed keys.

    python -m radixserve.bench.grammar_bench                 # model M, batches 1 and 32 (a few minutes on 2 cores)
    python -m radixserve.bench.grammar_bench --model tiny --size tiny --repeats 1   # seconds

Writes grammar_bench.{json,md} (bench/output.py says where). Every timed run sends `batch` distinct random-token prompts at
once, greedy, after an emptied prefix cache; the cases of one repeat use the same prompts and run one after the
other (alternating), and each figure is the median of --repeats.

* schema vs unconstrained, fixed output length: the schema is a JSON string of exactly L characters, with L
  larger than output_len times the longest token's text, so it can never close within output_len tokens and
  every request ends with "length" after exactly output_len tokens, as the unconstrained ones (ignore_eos) do.
  The gap is the grammar's work per token (mask fill, accept, the jump-forward probe) and the masked sampling.
* jump-forward on vs off: an object of long fixed keys with short values; requests end with "stop" (checked
  against the schema). The two engines differ in `disable_jump_forward` only. Outputs are the same JSON text
  up to the values, but retokenization may merge tokens, so requests/s and characters/s compare the two, and
  tokens/s is shown as well.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import time
from collections import Counter
from typing import Any

from .harness import MODEL_HELP, bench_model_path
from .output import BenchOutput, bench_parser, parse_args, progress
from .workloads import TOKEN_HI, TOKEN_LO

logger = logging.getLogger(__name__)

SIZES = {
    "default": dict(batches=(1, 32), output_len=32, prompt_len=32, num_keys=4),
    "tiny": dict(batches=(1, 2), output_len=8, prompt_len=8, num_keys=3),
}
LONG_KEYS = ["customer_identification_number", "preferred_method_of_contact", "account_is_currently_active",
             "shipping_destination_city_code", "estimated_delivery_window_days", "loyalty_programme_tier",
             "most_recent_purchase_category", "has_opted_into_marketing_emails"]
_VALUES = [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["yes", "no"]}, {"type": "boolean"}]
JUMP_MAX_NEW = 400  # above the long-key schema's longest output in tokens
CASES = ("unconstrained", "json_schema", "jump_off", "jump_on")


def fixed_length_schema(num_chars: int) -> dict[str, Any]:
    return {"type": "string", "minLength": num_chars, "maxLength": num_chars}


def long_keys_schema(num_keys: int) -> dict[str, Any]:
    keys = LONG_KEYS[:num_keys]
    return {"type": "object", "properties": {k: _VALUES[i % len(_VALUES)] for i, k in enumerate(keys)},
            "required": keys}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from ..scheduler import Engine

    torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else size["batches"]
    output_len, prompt_len, num_keys = size["output_len"], size["prompt_len"], size["num_keys"]
    model_path = bench_model_path(args.model)
    config = dict(max_running_requests=max(batches), num_threads=args.threads,
                  kv_cache_tokens=max(batches) * (prompt_len + JUMP_MAX_NEW) + 1024)
    engines = {jump: Engine(model_path, disable_jump_forward=not jump, **config) for jump in (True, False)}
    longest = max(len(engines[True].tokenizer.decode([i], skip_special_tokens=False))
                  for i in range(engines[True].tokenizer.vocab_size))
    fixed = fixed_length_schema(output_len * max(longest, 1) + 1)
    keyed = long_keys_schema(num_keys)
    case_params = {
        "unconstrained": dict(max_new_tokens=output_len, temperature=0.0, ignore_eos=True),
        "json_schema": dict(json_schema=fixed, max_new_tokens=output_len, temperature=0.0),
        "jump_off": dict(json_schema=keyed, max_new_tokens=JUMP_MAX_NEW, temperature=0.0),
        "jump_on": dict(json_schema=keyed, max_new_tokens=JUMP_MAX_NEW, temperature=0.0),
    }
    case_engine = {"unconstrained": engines[True], "json_schema": engines[True], "jump_off": engines[False],
                   "jump_on": engines[True]}
    for engine in engines.values():  # warm-up: first-call costs and the grammar compiles stay out of timings
        for params in case_params.values():
            engine.generate([[TOKEN_LO] * prompt_len], dict(params, max_new_tokens=min(params["max_new_tokens"], 4)))
    raw: dict[str, list[dict[str, Any]]] = {f"{case}@{b}": [] for case in CASES for b in batches}
    t_start = time.perf_counter()
    with progress(args.repeats * len(batches) * len(CASES), "grammar bench") as bar:
        for rep in range(args.repeats):
            for batch in batches:
                rng = random.Random(1000 * rep + batch)
                prompts = [[rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(prompt_len)] for _ in range(batch)]
                for case in CASES:
                    row = timed_run(case_engine[case], prompts, case_params[case],
                                    schema=keyed if case.startswith("jump") else None)
                    raw[f"{case}@{batch}"].append(row)
                    logger.info("repeat %d batch %d %s: %.2f s, %.1f tok/s", rep, batch, case, row["wall_s"],
                                row["tok_per_s"])
                    bar.update()
    for engine in engines.values():
        engine.shutdown()
    report = {
        "command": args.command,
        "model": args.model, "model_path": model_path, "threads": args.threads, "repeats": args.repeats,
        "batches": list(batches), "prompt_len": prompt_len, "output_len": output_len,
        "fixed_schema_chars": fixed["minLength"], "long_keys_schema": keyed, "python": platform.python_version(),
        "bench_wall_s": time.perf_counter() - t_start,
        "cases": {key: summarize(rows) for key, rows in raw.items()}, "runs": raw,
    }
    report["ratios"] = ratios(report["cases"], batches)
    out = BenchOutput("grammar_bench", args.out)
    out.finish(out.write_report("grammar_bench", report, render_markdown(report)))
    return report


def timed_run(engine: Any, prompts: list[list[int]], params: dict[str, Any],
              schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """One batch, all at once, from an emptied prefix cache; counters are the stats() deltas."""
    engine.flush_cache()
    keys = ("num_steps", "num_forward_tokens", "num_jump_forward_steps", "num_jump_forward_tokens")
    before = engine.stats()
    start = time.perf_counter()
    results = engine.generate(prompts, [params] * len(prompts))
    wall = time.perf_counter() - start
    after = engine.stats()
    valid = True
    if schema is not None:
        try:
            for r in results:
                value = json.loads(r.text, strict=False)
                valid = valid and isinstance(value, dict) and set(value) == set(schema["properties"])
        except ValueError:
            valid = False
    tokens = sum(r.completion_tokens for r in results)
    return {"wall_s": wall, "num_requests": len(results), "completion_tokens": tokens,
            "output_chars": sum(len(r.text) for r in results), "tok_per_s": tokens / wall,
            "req_per_s": len(results) / wall, "chars_per_s": sum(len(r.text) for r in results) / wall,
            "finish": dict(Counter(r.finish_reason for r in results)), "valid": valid,
            **{k: after[k] - before[k] for k in keys}}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timed figures; counts from the median-time run; validity over all runs."""
    ordered = sorted(rows, key=lambda r: r["wall_s"])
    mid = ordered[len(ordered) // 2]
    out = {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "tok_per_s", "req_per_s", "chars_per_s")}
    out.update({k: mid[k] for k in ("num_requests", "completion_tokens", "output_chars", "num_steps",
                                    "num_forward_tokens", "num_jump_forward_steps", "num_jump_forward_tokens",
                                    "finish")})
    out["valid"] = all(r["valid"] for r in rows)
    return out


def ratios(cases: dict[str, dict[str, Any]], batches: tuple[int, ...] | list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in batches:
        free, schema = cases[f"unconstrained@{b}"], cases[f"json_schema@{b}"]
        off, on = cases[f"jump_off@{b}"], cases[f"jump_on@{b}"]
        out[str(b)] = {
            "schema_vs_unconstrained_tok_per_s": schema["tok_per_s"] / free["tok_per_s"],
            "jump_on_vs_off_req_per_s": on["req_per_s"] / off["req_per_s"],
            "jump_on_vs_off_chars_per_s": on["chars_per_s"] / off["chars_per_s"],
            "jump_on_vs_off_steps": on["num_steps"] / max(off["num_steps"], 1),
        }
    return out


def render_markdown(report: dict[str, Any]) -> str:
    c, q = report["cases"], report["ratios"]
    schema_rows, jump_rows = [], []
    for b in report["batches"]:
        free, schema = c[f"unconstrained@{b}"], c[f"json_schema@{b}"]
        off, on = c[f"jump_off@{b}"], c[f"jump_on@{b}"]
        r = q[str(b)]
        schema_rows.append(f"| {b} | {free['tok_per_s']:.1f} | {schema['tok_per_s']:.1f} | "
                           f"**{r['schema_vs_unconstrained_tok_per_s']:.2f}x** | {_finish(free)} / {_finish(schema)} |")
        jump_rows.append(
            f"| {b} | {off['req_per_s']:.2f} / {on['req_per_s']:.2f} | **{r['jump_on_vs_off_req_per_s']:.2f}x** | "
            f"{off['chars_per_s']:.0f} / {on['chars_per_s']:.0f} | {off['tok_per_s']:.1f} / {on['tok_per_s']:.1f} | "
            f"{off['num_steps']} / {on['num_steps']} | "
            f"{on['num_jump_forward_tokens']} of {on['completion_tokens']} | "
            f"{'yes' if off['valid'] and on['valid'] else 'NO'} |")
    keys = ", ".join(f"`{k}`" for k in report["long_keys_schema"]["properties"])
    return "\n".join([
        "# Structured generation bench: JSON schema cost and jump-forward",
        "",
        f"Command: `{report['command'].strip()}`",
        "",
        f"Model {report['model']} (`{report['model_path']}`), {report['threads']} torch thread(s), greedy; "
        f"{report['prompt_len']}-token random prompts, one batch of `batch` requests at a time from an emptied "
        f"prefix cache; median of {report['repeats']} alternating repeats after a warm-up "
        f"(bench wall time {report['bench_wall_s']:.0f} s). Absolute times on a shared machine are noise; "
        "compare the ratios.",
        "",
        f"## JSON schema vs unconstrained ({report['output_len']} output tokens per request)",
        "",
        f"Schema: a string of exactly {report['fixed_schema_chars']} characters (never closes within the output "
        "length, so each request ends with `length` at exactly that many tokens, as the unconstrained "
        "`ignore_eos` ones).",
        "",
        "| batch | unconstrained tok/s | json_schema tok/s | schema / unconstrained | finish |",
        "|---|---|---|---|---|",
        *schema_rows,
        "",
        "## Jump-forward off vs on (schema with long fixed keys)",
        "",
        f"Keys: {keys}; short values (digit, yes/no, boolean). Every request ends with `stop`; outputs checked.",
        "",
        "| batch | req/s off / on | on / off | chars/s off / on | tok/s off / on | forwards (steps) off / on "
        "| forced tokens (on) | valid |",
        "|---|---|---|---|---|---|---|---|",
        *jump_rows,
        "",
    ])


def _finish(summary: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(summary["finish"].items()))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("grammar_bench", __doc__)
    p.add_argument("--model", default="M", help=MODEL_HELP)
    p.add_argument("--size", choices=sorted(SIZES), default="default",
                   help="batch sizes, prompt and output lengths: "
                        + "; ".join(f"{k}: batches {','.join(map(str, v['batches']))}, {v['prompt_len']} prompt and "
                                    f"{v['output_len']} output tokens" for k, v in SIZES.items()))
    p.add_argument("--batches", help="comma-separated batch sizes (default: the size's)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of every case; the report gives their median")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (more than the free cores slows every thread down)")
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
