"""radixserve vs llama.cpp's own server (llama-server), side by side on the same checkpoint, prompts and client:
requests/s, time to first token and per output token, and the prompt tokens each server computed, on agent-style
workloads; then single-stream prefill and decode tokens/s of both (~25 min on model L).

    python -m radixserve.bench.peer_llamacpp --model L --llama-server /tmp/peers/llama.cpp/build/bin/llama-server \\
        --gguf /tmp/peers/gguf                  # the first time converts the checkpoint into /tmp/peers/gguf/
    python -m radixserve.bench.peer_llamacpp --model tiny --size tiny --runs 1 --llama-slots c \\
        --llama-server ... --gguf ...            # a smoke test (about a minute)
    python -m radixserve.bench.peer_llamacpp --model /tmp/peers/gguf/L-q4_0.gguf --workloads gsp \\
        --llama-server ...                       # the very same quantized file in both engines (issue 39)
    python -m radixserve.bench.peer_llamacpp --model FILE.gguf --workloads "" --single-batch 16 --llama-server ...

llama.cpp is not a dependency; build it outside the repository (Release, about 15 min on 2 cores):

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/peers   # the sdist vendors llama.cpp
    tar xzf /tmp/peers/llama_cpp_python-*.tar.gz -C /tmp/peers
    mv /tmp/peers/llama_cpp_python-*/vendor/llama.cpp /tmp/peers/llama.cpp && cd /tmp/peers/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=OFF \\
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
    cmake --build build -j2 --target llama-server llama-batched-bench llama-bench llama-quantize

(the instruction sets named, not -march=native: this machine's image has moved between hosts of different CPUs,
an Intel one with AMX at one stop, an AMD Zen 5 without AMX or AVX512-FP16 at the next, and a build for the
first host's CPU can trap with invalid opcodes on the second; on a CPU without AVX-512 drop those flags.)

--gguf is a GGUF of the checkpoint in --dtype, or a directory: the bench then converts the checkpoint there (once)
with the source tree's convert_hf_to_gguf.py (found two levels above llama-server, or --convert-script), run by
--convert-python: a Python with torch, transformers and sentencepiece, e.g. a venv made with
--system-site-packages plus `pip install sentencepiece`. The bench checkpoints' tokenizer (a byte-level BPE with
GPT-2's split regex) has a pre-tokenizer hash the converter does not know; for such a tokenizer only, the bench
lets it write "gpt-2". Requests go as token ids, so llama.cpp never tokenizes text here.

What runs (--threads T for both):
  radixserve   `radixserve serve --model PATH --dtype D --num-threads T --max-running-requests C --kv-cache-tokens K`
               (K: every prompt and output, nothing evicts), started once, /flush_cache before each run;
  llama.cpp    `llama-server -m GGUF --threads T --threads-batch T --parallel P --[no-]kv-unified -c P*L
               --threads-http C+4` (L: the longest prompt + output), a fresh server per run: its RAM prompt cache
               cannot be emptied over HTTP.
Requests go from C keep-alive connections in this process, a closed loop (bench/http_client.py): radixserve POST
/generate {input_ids, sampling_params {max_new_tokens, temperature 0, ignore_eos}}, streamed, TTFT and TPOT timed
at the client; llama.cpp POST /completion {prompt: ids, n_predict, temperature 0, top_k 1, ignore_eos,
cache_prompt, return_tokens}, not streamed (its stream drops the ids of tokens that end inside a UTF-8 sequence),
TTFT = the client's latency - the server's first-to-last-token time (timings.predicted_ms), TPOT = that / (n - 1).
A workload runs round by round; a round's next prompts use the same engine's outputs. Per workload, llama.cpp runs
once with each --llama-slots setting and keeps the best req/s; then the engines alternate (ours, llama.cpp;
llama.cpp, ours; ...).
Single stream: llama-batched-bench (-npp CONTEXT -ntg NEW -npl 1) vs Engine in-process, alternating.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any, Callable
from urllib.parse import urlsplit

import orjson
from ._llamacpp import DTYPES, LlamaServer, measure_single, parse_slots, resolve_gguf
from .harness import MODEL_HELP, stand_in_rounds
from .http_bench import Timing, summarize_run
from .http_client import HTTPConnection
from ..radix.optimal import optimal_counts
from .output import BenchOutput, bench_parser, parse_args, progress
from .peer_vllm import alternation
from .report_llamacpp import LLAMA, OURS, build_report, write_report
from .workloads import SIZES, ReAct, SharedSystemPrompt, WorkRequest, Workload, make_workload

logger = logging.getLogger(__name__)

# full (= real): issue 35's shapes, gsp 2 groups x 8 on 1,024 + 64 tokens, react one agent per client, 64 output
# tokens each (bench.workloads' "real" size); reduced and tiny keep the same structure, smaller.
PRESETS: dict[str, dict[str, Callable[[int], Workload]]] = {
    "gsp": {"reduced": lambda s: SharedSystemPrompt(2, 8, 256, 32, 16, seed=s),
            "tiny": lambda s: SharedSystemPrompt(2, 4, 32, 8, 4, seed=s)},
    "react": {"reduced": lambda s: ReAct(16, 3, 160, 24, (16, 64), 16, seed=s),
              "tiny": lambda s: ReAct(4, 3, 32, 8, (4, 12), 4, seed=s)},
    "gsp_long": {size: (lambda s, size=size: make_workload("gsp_long", size, s)) for size in ("reduced", "tiny")},
}
for _name, _sizes in PRESETS.items():
    _sizes["full"] = _sizes["real"] = lambda s, name=_name: make_workload(name, "real", s)
CLIENTS = {"gsp": 16, "react": 16, "gsp_long": 32}


# -- the two servers ------------------------------------------------------------------------------


class OursServer:
    """`radixserve serve` (frontend.spawn.ServerProcess: port 0, ready line); flush() empties its prefix cache."""

    def __init__(self, model_path: str, dtype: str, threads: int, max_running: int, kv_tokens: int,
                 extra: list[str]) -> None:
        from ..frontend.spawn import ServerProcess

        self.args = ["--model", model_path, "--dtype", DTYPES[dtype], "--num-threads", str(threads),
                     "--max-running-requests", str(max_running), "--kv-cache-tokens", str(kv_tokens), *extra]
        self.proc = ServerProcess(self.args, env={"OMP_NUM_THREADS": str(threads)})
        self.url = self.proc.url

    def flush(self) -> None:
        import httpx

        deadline = time.monotonic() + 60
        while (response := httpx.post(self.url + "/flush_cache", timeout=60)).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"radixserve refused /flush_cache: {response.status_code} {response.text[:300]}")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.stop()


# -- the client -----------------------------------------------------------------------------------


def request_body(engine: str, req: WorkRequest) -> tuple[str, bytes]:
    if engine == OURS:
        return "/generate", orjson.dumps({"input_ids": list(req.prompt_ids), "stream": True, "sampling_params": {
            "max_new_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True}})
    # Not streamed: llama-server's stream leaves out the id of every token it holds back while the text so far
    # ends inside a UTF-8 sequence, and a chained workload's next prompt needs every output id.
    return "/completion", orjson.dumps({"prompt": list(req.prompt_ids), "n_predict": req.max_new_tokens,
                                        "temperature": 0.0, "top_k": 1, "ignore_eos": True, "cache_prompt": True,
                                        "stream": False, "return_tokens": True})


def read_event(event: dict[str, Any], timing: Timing, output: list[int]) -> list[int]:
    """radixserve: the new output ids of one streamed /generate event (they are cumulative); on the last one
    (finish_reason set), the cached prompt tokens into `timing`."""
    if "error" in event:
        raise RuntimeError(f"radixserve: {event['error']}")
    meta = event.get("meta_info") or {}
    if meta.get("finish_reason") is not None:
        timing.cached_tokens = meta["cached_tokens"]
    return list(event.get("output_ids") or [])[len(output):]


def read_reply(reply: dict[str, Any], timing: Timing, latency_s: float) -> list[int]:
    """llama.cpp: the output ids of one /completion reply. The server's timings give the prompt tokens computed
    (prompt_n) and reused (cache_n), and the time from the first token to the last (predicted_ms): TTFT = the
    client's latency - that; TPOT = that / (tokens - 1)."""
    if "error" in reply:
        raise RuntimeError(f"llama.cpp: {reply['error']}")
    timings, output = reply["timings"], list(reply["tokens"])
    if timings["prompt_n"] + timings["cache_n"] != timing.prompt_tokens:
        raise RuntimeError(f"llama.cpp counted {timings['prompt_n']} + {timings['cache_n']} prompt tokens "
                           f"for a prompt of {timing.prompt_tokens}")
    timing.cached_tokens = timings["cache_n"]
    timing.output_tokens = len(output)
    timing.ttft_s, timing.last_s = latency_s - timings["predicted_ms"] / 1000, latency_s
    return output


async def send(conn: HTTPConnection, engine: str, req: WorkRequest) -> tuple[Timing, list[int]]:
    timing, output = Timing(prompt_tokens=len(req.prompt_ids)), []
    path, body = request_body(engine, req)
    start = time.perf_counter()
    if engine == OURS:
        async for line in conn.post_lines(path, body):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                new = read_event(orjson.loads(line[6:]), timing, output)
                timing.token(time.perf_counter() - start, len(new))
                output += new
    else:
        reply = b"".join([line async for line in conn.post_lines(path, body)])
        output = read_reply(orjson.loads(reply), timing, time.perf_counter() - start)
    if len(output) != req.max_new_tokens:
        raise RuntimeError(f"{engine} {req.key}: {len(output)} tokens, {req.max_new_tokens} asked for")
    return timing, output


async def run_workload(url: str, engine: str, workload: Workload, clients: int) -> dict[str, Any]:
    """Every round of `workload`, each through a closed loop of `clients` connections; the run's summary."""
    parts = urlsplit(url)
    conns = [HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80) for _ in range(clients)]
    outputs: dict[str, list[int]] = {}
    timings, rounds, wall_s = [], [], 0.0
    try:
        for idx in range(workload.num_rounds):
            requests = workload.make_round(idx, outputs).requests
            queue, done = deque(requests), {}

            async def worker(conn: HTTPConnection) -> None:
                while queue:
                    req = queue.popleft()
                    done[req.key] = await send(conn, engine, req)

            start = time.perf_counter()
            await asyncio.gather(*(worker(c) for c in conns))
            wall_s += time.perf_counter() - start
            for req in requests:
                timing, outputs[req.key] = done[req.key]
                timings.append(timing)
            rounds.append([(r.prompt_ids, outputs[r.key]) for r in requests])
    finally:
        for conn in conns:
            await conn.close()
    summary = summarize_run(timings, wall_s)
    optimal = optimal_counts(rounds)
    return {**summary, "computed_tokens": summary["prompt_tokens"] - summary["cached_tokens"],
            "optimal_computed_tokens": optimal.computed_tokens, "optimal_hit_rate": optimal.hit_rate}


async def warm_up(url: str, engine: str) -> None:
    """One short request, so that first-call costs stay out of the run."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80)
    try:
        await send(conn, engine, WorkRequest("warm-up", list(range(100, 164)), 4))
    finally:
        await conn.close()


# -- measuring ------------------------------------------------------------------------------------


class Bench:
    """Both engines on the workloads: llama.cpp's slot sweep, then alternating runs."""

    def __init__(self, args: argparse.Namespace, ours: OursServer, gguf: str, work_dir: str,
                 on_run: Callable[[], object]) -> None:
        self.args, self.ours, self.gguf, self.work_dir, self.on_run = args, ours, gguf, work_dir, on_run
        self.runs: list[dict[str, Any]] = []
        self.sweep: list[dict[str, Any]] = []
        self.llama_commands: dict[str, str] = {}

    def workload(self, name: str) -> None:
        clients = self.args.clients or CLIENTS[name]
        settings = self.args.llama_slots
        if len(settings) > 1:
            tries = [self.one_run(LLAMA, name, clients, -1, s) for s in settings]
            best = max(tries, key=lambda r: r["req_per_s"])
            for t in tries:
                self.sweep.append({**t, "chosen": t is best})
            settings = [best["settings"]]
        for rep, order in enumerate(alternation([OURS, LLAMA], self.args.runs)):
            for engine in order:
                self.runs.append(self.one_run(engine, name, clients, rep, settings[0]))

    def one_run(self, engine: str, name: str, clients: int, rep: int, settings: str) -> dict[str, Any]:
        make = PRESETS[name][self.args.size]
        server: Any = self.ours
        if engine == LLAMA:  # a slot holds the longest prompt + output
            parallel, unified = parse_slots(settings, clients)
            settings = f"{parallel}{'u' if unified else ''}"
            longest = max(len(p) + len(o) for items in stand_in_rounds(lambda: make(self.args.seed))
                          for p, o, _ in items)
            log = os.path.join(self.work_dir, f"llama-{name}-{settings}-r{rep}.log")
            server = LlamaServer(self.args.llama_server, self.gguf, settings, clients,
                                 -(-(longest + 16) // 256) * 256, self.args.threads, log, self.args.llama_arg)
            self.llama_commands[f"{name} {settings}"] = "llama-server " + " ".join(server.args)
        try:
            asyncio.run(warm_up(server.url, engine))
            if engine == OURS:
                server.flush()
            time.sleep(self.args.settle_s)
            record = asyncio.run(run_workload(server.url, engine, make(self.args.seed), clients))
        finally:
            if engine == LLAMA:
                server.close()
        record = {"engine": engine, "workload": name, "rep": rep, "clients": clients,
                  "settings": settings if engine == LLAMA else None, **record}
        logger.info("%s rep %d %s%s: %.2f req/s, hit rate %.3f (optimal %.3f)", name, rep, engine,
                    f" [{settings}]" if engine == LLAMA else "", record["req_per_s"], record["hit_rate"] or 0.0,
                    record["optimal_hit_rate"])
        self.on_run()
        return record


# -- driver ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from .harness import bench_model_path

    started, load_start = time.perf_counter(), os.getloadavg()[0]
    same_file = args.model.endswith(".gguf") and os.path.isfile(args.model)  # both engines load the very file
    model_path = args.model if same_file else bench_model_path(args.model)
    gguf = args.model if same_file else resolve_gguf(args.gguf, model_path, args.dtype, args.llama_server,
                                                     args.convert_script, args.convert_python)
    kv = max((sum(len(p) + len(o) for items in stand_in_rounds(lambda n=n: PRESETS[n][args.size](args.seed))
                  for p, o, _ in items) for n in args.workloads), default=0) + 256
    sweeps = sum(len(args.llama_slots) for _ in args.workloads) if len(args.llama_slots) > 1 else 0
    total = sweeps + 2 * args.runs * (len(args.workloads) + (0 if args.no_single_stream else 1))
    with progress(total, "llama.cpp peer") as bar:
        runs, sweep, engines = _run_workloads(args, model_path, gguf, kv, bar.update) if args.workloads else ([], [], {})
        single = [] if args.no_single_stream else measure_single(args, model_path, gguf, bar.update)
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, check=False)
    meta = {"command": args.command, "model": args.model, "model_path": os.path.basename(model_path),
            "dtype": args.dtype, "gguf": gguf, "size": args.size, "seed": args.seed, "runs": args.runs,
            "threads": args.threads, "settle_s": args.settle_s, "kv_cache_tokens": kv,
            "llama_server_version": (version.stdout + version.stderr).strip()[-200:],
            "engines": engines,
            "load_average": {"start": load_start, "end": os.getloadavg()[0]},
            "elapsed_s": time.perf_counter() - started,
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    report = build_report(runs, sweep, single, meta)
    out = BenchOutput("peer_llamacpp", args.out)
    out.finish(write_report(report, out))
    return report


def _run_workloads(args: argparse.Namespace, model_path: str, gguf: str, kv: int,
                   on_run: Callable[[], object]) -> tuple[list[dict], list[dict], dict[str, str]]:
    """Both servers on the workloads: (runs, llama.cpp's slot sweep, each server's command)."""
    work_dir = tempfile.mkdtemp(prefix="radixserve-peer-llamacpp-")  # llama-server logs, kept on failure
    ours = OursServer(model_path, args.dtype, args.threads, max(args.clients or CLIENTS[n] for n in args.workloads),
                      kv, args.radixserve_arg)
    try:
        bench = Bench(args, ours, gguf, work_dir, on_run)
        for name in args.workloads:
            bench.workload(name)
    except BaseException:
        logger.warning("llama-server logs stay in %s", work_dir)
        raise
    finally:
        ours.close()
    shutil.rmtree(work_dir, ignore_errors=True)
    return bench.runs, bench.sweep, {OURS: "radixserve serve " + " ".join(ours.args), **bench.llama_commands}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = bench_parser("peer_llamacpp", __doc__)
    p.epilog = __doc__.split("\n\n", 1)[1]  # usage, how to build llama.cpp and convert the checkpoint, the method
    p.add_argument("--model", default="L", help=MODEL_HELP + "; or a GGUF file, which both engines load")
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES), help="weights of both engines (and of the GGUF)")
    p.add_argument("--llama-server", required=True, metavar="PATH",
                   help="llama.cpp's llama-server binary (llama-batched-bench is looked for beside it)")
    p.add_argument("--gguf", metavar="PATH",
                   help="the checkpoint as a GGUF file in --dtype, or a directory to convert it into (once); not "
                        "with --model FILE.gguf, which both engines load (radixserve keeps its blocks quantized)")
    p.add_argument("--convert-script", metavar="PATH",
                   help="llama.cpp's convert_hf_to_gguf.py (default: in the source tree above llama-server)")
    p.add_argument("--convert-python", default=sys.executable, metavar="PYTHON",
                   help="the Python that runs the converter (needs torch, transformers, sentencepiece)")
    p.add_argument("--workloads", type=lambda s: [w for w in s.split(",") if w], default=list(PRESETS),
                   metavar="LIST", help="comma-separated, from " + ", ".join(PRESETS) + " (empty: the single stream only)")
    p.add_argument("--size", default="full", choices=SIZES,
                   help="workload size (full and real: shapes for real-size models such as L, 64 output tokens each)")
    p.add_argument("--clients", type=int, metavar="N",
                   help="connections sending requests (default: gsp 16, react 16, gsp_long 32)")
    p.add_argument("--llama-slots", type=lambda s: s.split(","), default=["4", "c", "cu"], metavar="LIST",
                   help="llama-server settings to try per workload, comma-separated: N = --parallel N with a KV "
                        "cache per slot, Nu = --parallel N with one unified KV cache, c = as many slots as clients; "
                        "the best req/s is measured (one setting: no tries)")
    p.add_argument("--runs", type=int, default=3, help="runs per engine and workload, alternating (median)")
    p.add_argument("--threads", type=int, default=2, help="threads of each engine")
    p.add_argument("--single-context", type=int, default=1024, help="single stream: prompt tokens")
    p.add_argument("--single-new-tokens", type=int, default=64, help="single stream: tokens generated")
    p.add_argument("--single-batch", type=int, default=1,
                   help="sequences decoded together in the single-stream part (16: batch-16 decode)")
    p.add_argument("--no-single-stream", action="store_true", help="skip the single-stream prefill/decode part")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="extra llama-server argument (repeatable)")
    p.add_argument("--radixserve-arg", action="append", default=[], metavar="ARG",
                   help="extra `radixserve serve` argument (repeatable, e.g. "
                        "--radixserve-arg=--chunked-prefill-size=1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--settle-s", type=float, default=3.0, help="idle seconds before each run")
    args = parse_args(p, argv)
    if unknown := [w for w in args.workloads if w not in PRESETS]:
        p.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    for slots in args.llama_slots:
        try:
            parse_slots(slots, 1)
        except ValueError as exc:
            p.error(str(exc))
    if args.runs < 1 or (args.clients is not None and args.clients < 1):
        p.error("--runs and --clients must be >= 1")
    if args.gguf is None and not args.model.endswith(".gguf"):
        p.error("--gguf is needed unless --model is a GGUF file")
    if not os.access(args.llama_server, os.X_OK):
        p.error(f"--llama-server {args.llama_server}: not an executable file")
    return args


if __name__ == "__main__":
    main()
