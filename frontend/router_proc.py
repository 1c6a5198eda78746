"""The real sglang-router (`pip install 'radixserve[router]'`) as a subprocess, and the calls the
replica supervisor makes to its worker API (frontend/replicas.py).

radixserve grows no router of its own: SGLang's Rust router keeps an approximate radix tree of the
prompt text each worker has seen and sends a request to the worker with the longest match
(`cache_aware`), falling back to the least loaded one when the load is unbalanced. It registers a
worker by probing /health, /server_info (then /get_server_info) and /model_info (then
/get_model_info), and passes the generation endpoints, the Authorization header included, through.

Worker API used here (sglang-router 0.3.2): GET /workers lists {id, url, is_healthy}; POST /workers
{"url": ..., "api_key": ...} adds one (the key it sends on its probes of that worker); DELETE /workers/{id} removes one (both queued, applied within a moment).
Torch-free; stdlib HTTP only (httpx is a test dependency, not a runtime one).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from .spawn import stop_process

logger = logging.getLogger("radixserve.router")

ROUTER_MODULE = "sglang_router.launch_router"
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 5.0
# How long the router keeps an idle connection to a worker for reuse (its reqwest pool). A worker that closes an
# idle connection sooner races the router's next request on it (the request meets a closed socket).
POOL_IDLE_S = 50.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its log even into a pipe
_ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error", "critical": "error"}


class RouterError(RuntimeError):
    """The router did not start, or did not take a worker change."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_installed() -> None:
    """A clear error before any worker loads its model, instead of a traceback from the child."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("--replicas > 1 runs sglang-router in front of the workers; install it with "
                         "pip install 'radixserve[router]' (sglang-router==0.3.2)")


class RouterProcess:
    """`python -m sglang_router.launch_router --worker-urls ... --policy POLICY` on host:port."""

    def __init__(self, worker_urls: list[str], host: str, port: int, policy: str, api_key: str | None,
                 log_level: str = "info") -> None:
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", ROUTER_MODULE, "--worker-urls", *worker_urls, "--policy", policy,
               "--host", host, "--port", str(port),
               # Its Prometheus listener would take port 29000 for every router on the machine.
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "5", "--log-level", _ROUTER_LOG_LEVELS[log_level],
               # Retries (with backoff) span ~3 s, not 0.7: the supervisor's removal of a dead worker
               # lands before a request that first hit it runs out of them.
               "--retry-max-retries", "8", "--retry-initial-backoff-ms", "100",
               # Its circuit breaker counts a worker's 429 (queue full) as a failure: one burst past the queues
               # opened every circuit and the router answered 503 "no available workers" to everything for up to
               # a minute. A dead worker is taken out by the supervisor at once and by the health checks.
               "--disable-circuit-breaker"]
        if api_key is not None:
            cmd += ["--api-key", api_key]  # the router then asks for it too, and sends it on its probes
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # stopped by the supervisor after the workers drain
        threading.Thread(target=_forward, args=(self.proc.stdout, "router | "), daemon=True).start()

    def wait_ready(self, num_workers: int, timeout: float = START_TIMEOUT_S) -> None:
        """Until the router answers and lists `num_workers` healthy workers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RouterError(f"sglang-router exited with status {self.proc.returncode} (its log is above)")
            try:
                if sum(w.get("is_healthy", False) for w in self.workers()) >= num_workers:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RouterError(f"sglang-router did not list {num_workers} healthy workers within {timeout:g}s")

    def workers(self) -> list[dict[str, Any]]:
        return self._call("GET", "/workers")["workers"]

    def add_worker(self, url: str) -> None:
        spec = {"url": url} if self.api_key is None else {"url": url, "api_key": self.api_key}
        self._call("POST", "/workers", spec)

    def remove_worker(self, url: str) -> None:
        for worker in self.workers():
            if worker["url"] == url:
                self._call("DELETE", f"/workers/{worker['id']}")

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then kill after `timeout`; returns the exit status."""
        return stop_process(self.proc, timeout)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise RouterError(f"sglang-router {method} {path}: {exc.code} {exc.read()[:200]!r}") from exc


def _forward(stream: Any, prefix: str) -> None:
    """A child's log lines onto this process's stderr, prefixed (drained so its pipe never blocks it)."""
    for line in stream:
        sys.stderr.write(prefix + _ANSI.sub("", line))
