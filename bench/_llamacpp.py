"""Parts of bench/peer_llamacpp.py: llama-server as a subprocess, the single-stream rates (llama-batched-bench
against radixserve's Engine in-process), and the checkpoint converted to GGUF with llama.cpp's own converter.
Nothing of llama.cpp is imported or shipped: the binaries and the converter come from a source tree the user built
(see peer_llamacpp's --help)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import time
from typing import Any, Callable

from ..frontend.router_proc import free_port
from .peer_vllm import alternation
from .report_llamacpp import LLAMA, OURS

logger = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # --dtype: GGUF outtype -> radixserve's dtype


class LlamaServer:
    """llama-server in its own session (stopped as a group), its log in `log_path`."""

    def __init__(self, binary: str, gguf: str, settings: str, clients: int, context: int, threads: int,
                 log_path: str, extra: list[str], timeout_s: float = 300.0) -> None:
        parallel, unified = parse_slots(settings, clients)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.args = ["-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
                     "--threads-batch", str(threads), "--parallel", str(parallel),
                     "--kv-unified" if unified else "--no-kv-unified", "-c", str(parallel * context),
                     "--threads-http", str(max(clients, parallel) + 4), "--no-webui", *extra]
        self.log_path = log_path
        with open(log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen([binary, *self.args], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited (rc {self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"llama-server not ready in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_lines: int = 30) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait()


def parse_slots(settings: str, clients: int) -> tuple[int, bool]:
    """'16' -> (16, per-slot KV); '16u' -> (16, unified KV); 'c' / 'cu': as many slots as clients."""
    unified = settings.endswith("u")
    count = settings[:-1] if unified else settings
    if count == "c":
        return clients, unified
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"bad llama.cpp slot setting {settings!r}: use N, Nu, c or cu (N >= 1)")
    return int(count), unified


def single_llama(binary: str, gguf: str, context: int, new_tokens: int, threads: int,
                 attempts: int = 6, batch: int = 1) -> dict[str, float]:
    """llama-batched-bench at `batch` sequences of their own prompt (-npl; -b/-ub: llama.cpp's defaults): prefill
    and decode tokens/s (all sequences together) from its JSON line. Run again when the line is missing: its
    asynchronous logger often exits before printing it (most runs of a tiny model on a loaded machine)."""
    cmd = [binary, "-m", gguf, "-c", str(batch * (context + new_tokens) + 64), "-b", "2048", "-ub", "512",
           "-npp", str(context), "-ntg", str(new_tokens), "-npl", str(batch), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl"]
    for _ in range(attempts):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            break
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"n_kv_max"')]
        if rows:
            return {"prefill_tok_s": rows[-1]["speed_pp"], "decode_tok_s": rows[-1]["speed_tg"]}
    raise RuntimeError(f"llama-batched-bench gave no result (rc {proc.returncode}):\n{proc.stderr[-2000:]}")


def single_ours(engine: Any, context: int, new_tokens: int, seed: int, batch: int = 1) -> dict[str, float]:
    """`batch` requests of `context` random ids each on an empty cache, together: prefill = their prompt tokens /
    the last TTFT; decode = the tokens after each one's first / the time from the last first token to the end (all
    sequences together, as llama-batched-bench counts them)."""
    from ..scheduler import SamplingParams

    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused: the engine still has requests")
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(context)] for _ in range(batch)]
    res = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    first, last = max(r.ttft_s for r in res), max(r.e2e_s for r in res)
    return {"prefill_tok_s": batch * context / first, "decode_tok_s": batch * (new_tokens - 1) / (last - first)}


def measure_single(args: argparse.Namespace, model_path: str, gguf: str, on_run: Callable[[], object]) -> list[dict]:
    from .harness import warm_up
    from ..scheduler import Engine

    batch = args.single_batch
    engine = Engine(model_path, dtype=DTYPES[args.dtype], num_threads=args.threads,
                    kv_cache_tokens=batch * (args.single_context + args.single_new_tokens) + 256,
                    max_running_requests=max(batch, 16))
    batched = os.path.join(os.path.dirname(args.llama_server), "llama-batched-bench")
    out = []
    try:
        warm_up(engine)
        for rep, order in enumerate(alternation([OURS, LLAMA], args.runs)):
            for name in order:
                time.sleep(args.settle_s)
                if name == OURS:
                    rates = single_ours(engine, args.single_context, args.single_new_tokens, args.seed + rep, batch)
                else:
                    rates = single_llama(batched, gguf, args.single_context, args.single_new_tokens, args.threads,
                                         batch=batch)
                out.append({"engine": name, "rep": rep, "context": args.single_context,
                            "new_tokens": args.single_new_tokens, "batch": batch, **rates})
                logger.info("single stream rep %d %s: prefill %.1f tok/s, decode %.1f tok/s", rep, name,
                            rates["prefill_tok_s"], rates["decode_tok_s"])
                on_run()
    finally:
        engine.shutdown()
    return out


# Runs the converter with one change: an unknown pre-tokenizer hash becomes argv[2] when that is not empty.
_CONVERT = r'''
import importlib, os, sys
script, fallback = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, os.path.dirname(script))
module = importlib.import_module("convert_hf_to_gguf")
try:
    from conversion.base import TextModel  # newer llama.cpp: the model classes live in conversion/
except ImportError:
    TextModel = module.TextModel
original = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        if not fallback:
            raise
        print("unknown pre-tokenizer hash: writing " + fallback, file=sys.stderr)
        return fallback
TextModel.get_vocab_base_pre = get_vocab_base_pre
module.main()
'''


def pre_tokenizer_fallback(model_path: str) -> str:
    """'gpt-2' for a tokenizer.json that splits with GPT-2's regex (a plain byte-level pre-tokenizer), else ''."""
    try:
        with open(os.path.join(model_path, "tokenizer.json"), encoding="utf-8") as f:
            pre = json.load(f).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return ""
    return "gpt-2" if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) else ""


def resolve_gguf(gguf: str, model_path: str, dtype: str, llama_server: str, script: str | None, python: str) -> str:
    """`gguf` as given when it is a file; for a directory, <dir>/<checkpoint>-<dtype>.gguf, converted there by
    `script` (default: convert_hf_to_gguf.py two levels above llama-server, its source tree) if missing."""
    if os.path.isfile(gguf):
        return gguf
    os.makedirs(gguf, exist_ok=True)
    path = os.path.join(gguf, f"{os.path.basename(os.path.normpath(model_path))}-{dtype}.gguf")
    if os.path.exists(path):
        return path
    script = script or os.path.join(os.path.dirname(os.path.abspath(llama_server)), "..", "..", "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        raise SystemExit(f"no convert_hf_to_gguf.py at {script}: give --convert-script, or a GGUF file as --gguf")
    logger.info("converting %s to %s", model_path, path)
    tmp = path[:-len(".gguf")] + ".part.gguf"  # renamed once complete: an interrupted run leaves no bad GGUF
    cmd = [python, "-c", _CONVERT, os.path.abspath(script), pre_tokenizer_fallback(model_path), model_path,
           "--outtype", dtype, "--outfile", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"converting to GGUF failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(tmp, path)
    return path
