"""`radixserve serve --replicas N` (alias --dp-size): N engine workers behind sglang-router, one URL.

    client --> sglang-router  (--host/--port, --router-policy cache_aware)
                 |-> worker 0: `radixserve serve` on 127.0.0.1:<free port>, its own engine process
                 |-> ...
                 '-> worker N-1

Each worker is a plain single-engine `radixserve serve` started from the same ServerConfig
(flags.config_argv), so every setting means the same thing with and without replicas. On GPUs each
worker sees one device (CUDA_VISIBLE_DEVICES; no tensor parallelism); on the CPU each gets
max(1, cores // N) torch threads unless --num-threads says otherwise. All workers share one
response store file (--response-store, or one in a temporary directory removed at exit), so a
/v1/responses follow-up with previous_response_id works whichever worker the router picks.

A worker that exits is removed from the router at once (requests in flight on it already failed
with its connections, and the router's retries must not pick it again), restarted after a backoff
(1 s, doubling to 30 s; reset once a worker stayed up a minute) and added back when ready.
Signals reach the supervisor only (the workers and the router run in sessions of their own, so a
terminal's Ctrl-C does not hit them all at once). The first SIGTERM/SIGINT drains: the workers
drain (admitted requests finish, new ones get 503) while the router still relays their answers,
then the router stops; exit status 0. A second one is passed on: each worker ends its open requests
with an error (streams get an error event, relayed by the router) and exits, then the router stops;
exit status 128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A third kills everything.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from . import preflight
from .config import ServerConfig
from .router_proc import POOL_IDLE_S, RouterError, RouterProcess, check_installed, free_port
from .response_store import ResponseStore
from .spawn import READY
from .thinking_signature import KEY_ENV

logger = logging.getLogger("radixserve.replicas")

WORKER_START_TIMEOUT_S = 600.0
BACKOFF_S = (1.0, 30.0)  # first and largest wait before a restart
STABLE_S = 60.0  # a worker up this long starts its next backoff from the first wait again
POLL_S = 0.1
ATTENTION = re.compile(r"\(attention: ([^)]*)\)")  # in a worker's ready line (frontend/launch.py)


class Worker:
    """One `radixserve serve` subprocess; restarted in place on a fresh port."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str]) -> None:
        self.index, self.argv, self.env = index, argv, env
        self.url = ""
        self.attention = ""  # what its ready line names
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self._ready = threading.Event()

    def start(self) -> None:
        self.url = ""
        self._ready.clear()
        cmd = [sys.executable, "-m", "radixserve.frontend.cli", "serve", *self.argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=self.env, start_new_session=True)  # signals come from the supervisor
        self.started_at = time.monotonic()
        threading.Thread(target=self._read_log, args=(self.proc,), daemon=True).start()

    def wait_ready(self, timeout: float, stop: threading.Event) -> bool:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(POLL_S):
            if stop.is_set() or self.exited() or time.monotonic() > deadline:
                return False
        return bool(self.url)

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if not self.exited():
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def _read_log(self, proc: subprocess.Popen) -> None:
        prefix = f"worker {self.index} | "
        for line in proc.stderr:
            match = READY.search(line)
            if match and proc is self.proc:
                self.url = match.group(1)
                attention = ATTENTION.search(line)
                self.attention = attention.group(1) if attention else "?"
                self._ready.set()
                continue  # the supervisor's own ready line is the one that names the client URL
            sys.stderr.write(prefix + line)
        if proc is self.proc:  # not a restarted worker's: its reader tells about its own start
            self._ready.set()


class Supervisor:
    def __init__(self, config: ServerConfig) -> None:
        self.stop = threading.Event()
        gpus = num_gpus(config)  # may refuse the settings: before anything is created
        self._store_dir: str | None = None
        if config.response_store is None:  # one file for all: a follow-up may reach any worker
            self._store_dir = tempfile.mkdtemp(prefix="radixserve-responses-")
            config = dataclasses.replace(config, response_store=os.path.join(self._store_dir, "responses.sqlite"))
        # created (WAL, schema) here, before the workers open it together
        ResponseStore(config.response_store, config.response_store_max_items, config.response_store_ttl_s).close()
        self.config = config
        argv = worker_argv(config, gpus)
        self.workers = [Worker(i, argv, env) for i, env in enumerate(worker_envs(config, gpus))]
        self.router: RouterProcess | None = None
        self.signals: list[int] = []  # the stop signals received
        self._lock = threading.Lock()  # a restart never starts a worker after shutdown() stopped them

    def run(self) -> int:
        for worker in self.workers:  # all load their models at once
            worker.start()
        for worker in self.workers:
            if not worker.wait_ready(WORKER_START_TIMEOUT_S, self.stop):
                stopped = self.stop.is_set()  # a signal while the models load
                if not stopped:
                    logger.error("worker %d did not start (its log is above)", worker.index)
                self.shutdown()
                return self.exit_status() if stopped else 1
            logger.info("worker %d ready on %s (pid %d)", worker.index, worker.url, worker.proc.pid)
        port = self.config.port or free_port(self.config.host)
        # With tenants (--api-keys) the router gets no key: given one, sglang-router 0.3.2 asks every client for
        # that key alone, and with a key per worker it sends that key on whatever it forwards, so the workers could
        # not tell tenants apart. Keyless, it passes the client's Authorization header through and each worker
        # resolves its tenant (x-api-key it does not forward); its start-up probes of /server_info and /model_info
        # get 401, and it registers the workers all the same.
        router_key = self.config.api_key if self.config.api_keys is None else None
        self.router = RouterProcess([w.url for w in self.workers], self.config.host, port,
                                    self.config.router_policy, router_key, self.config.log_level)
        try:
            self.router.wait_ready(len(self.workers))
        except RouterError as exc:
            logger.error("%s", exc)
            self.shutdown()
            return 1
        for worker in self.workers:
            threading.Thread(target=self._keep_alive, args=(worker,), daemon=True).start()
        logger.info("radixserve ready: serving %s on %s (%d replicas behind sglang-router, policy %s, attention: %s)",
                    self.config.model_name(), self.router.url, len(self.workers), self.config.router_policy,
                    ", ".join(sorted({w.attention for w in self.workers})))
        while not self.stop.wait(POLL_S):
            if self.router.proc.poll() is not None:
                logger.error("sglang-router exited with status %s; stopping", self.router.proc.returncode)
                self.shutdown()
                return 1
        self.shutdown()
        return self.exit_status()

    def exit_status(self) -> int:
        """0 after a drain; 128 + the second signal after a stop that did not wait."""
        return 128 + self.signals[1] if len(self.signals) > 1 else 0

    def _keep_alive(self, worker: Worker) -> None:
        """Restart `worker` whenever it exits, until the supervisor stops."""
        backoff = BACKOFF_S[0]
        while not self.stop.is_set():
            if not worker.exited():
                time.sleep(POLL_S)
                continue
            if time.monotonic() - worker.started_at > STABLE_S:
                backoff = BACKOFF_S[0]
            logger.error("worker %d (%s) exited with status %s; restarting in %.0fs", worker.index,
                         worker.url, worker.proc.returncode, backoff)
            self._router_call(self.router.remove_worker, worker.url)
            if self.stop.wait(backoff):
                return
            backoff = min(backoff * 2, BACKOFF_S[1])
            with self._lock:
                if self.stop.is_set():
                    return
                worker.start()
            if worker.wait_ready(WORKER_START_TIMEOUT_S, self.stop):
                self._router_call(self.router.add_worker, worker.url)
                logger.warning("worker %d is back on %s (pid %d)", worker.index, worker.url, worker.proc.pid)
            elif not self.stop.is_set() and not worker.exited():
                worker.proc.kill()  # alive but not ready in time: the next round restarts it

    def _router_call(self, call: Any, url: str) -> None:
        try:
            call(url)
        except (OSError, RouterError) as exc:  # the router's health checks catch up with it later
            logger.warning("sglang-router did not take the change for %s: %s", url, exc)

    def shutdown(self) -> None:
        """Drain the workers (the router relays their last answers), then stop the router."""
        with self._lock:
            self.stop.set()
            for worker in self.workers:
                worker.send_signal()
        for worker in self.workers:
            worker.wait(self.config.graceful_timeout_s + 10)
        if self.router is not None:
            self.router.stop(timeout=10)
        if self._store_dir is not None:  # the temporary store lives as long as the replicas (as in memory)
            shutil.rmtree(self._store_dir, ignore_errors=True)

    def handle_signal(self, sig: int, frame: Any) -> None:
        self.signals.append(sig)
        name = signal.Signals(sig).name
        if len(self.signals) == 1:
            logger.warning("received %s: draining %d workers (up to %g s); Ctrl-C again to stop now", name,
                           len(self.workers), self.config.graceful_timeout_s)
            self.stop.set()
        elif len(self.signals) == 2:
            logger.warning("received %s while draining: the workers end their open requests with an error now", name)
            for worker in self.workers:
                worker.send_signal()  # their second: they stop now (their first came from shutdown())
        else:
            logger.warning("received %s again: killing the workers and the router", name)
            for proc in [w.proc for w in self.workers] + [self.router.proc if self.router else None]:
                if proc is not None and proc.poll() is None:
                    proc.kill()


def run_replicas(config: ServerConfig) -> int:
    """Serve `config` with config.replicas workers behind sglang-router; returns the exit status."""
    check_installed()
    preflight.check_before_load(config)
    preflight.bind_listen_socket(config.host, config.port).close()  # a busy port now, not after N loads
    supervisor = Supervisor(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.handle_signal)
    return supervisor.run()


def worker_argv(config: ServerConfig, gpus: int) -> list[str]:
    """The single-engine `serve` flags of every worker: loopback, any free port, no replicas."""
    from .flags import config_argv

    one = dataclasses.replace(config, replicas=1, host="127.0.0.1", port=0,
                              keep_alive_s=max(config.keep_alive_s, POOL_IDLE_S + 15))
    argv = config_argv(one)
    if config.engine.num_threads is None and gpus == 0:
        cores = config.engine.resolved_num_threads()  # the cores this process may use
        argv += ["--num-threads", str(max(1, cores // config.replicas))]
    return argv


def worker_envs(config: ServerConfig, gpus: int) -> list[dict[str, str]]:
    """Each worker's environment: one GPU each (CUDA_VISIBLE_DEVICES) when on GPUs, and one thinking key for all
    (frontend/thinking_signature.py: a thinking block one worker signed verifies on the next turn's worker)."""
    base = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    base.setdefault(KEY_ENV, secrets.token_hex(32))  # --thinking-key, when given, wins over it
    if gpus == 0:
        return [dict(base) for _ in range(config.replicas)]
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = visible or [str(i) for i in range(config.replicas)]
    return [dict(base, CUDA_VISIBLE_DEVICES=devices[i]) for i in range(config.replicas)]


def num_gpus(config: ServerConfig) -> int:
    """GPUs the workers run on (0: the CPU); a clear error when there are fewer than replicas."""
    device = config.engine.device
    if device == "cpu":
        return 0
    if device is not None and re.fullmatch(r"cuda:\d+", device):
        raise ValueError(f"--device {device} pins one GPU; with --replicas each worker gets its own, "
                         "so pass --device cuda (or leave it unset)")
    count = preflight.cuda_device_count()
    if count == 0 and device is None:
        return 0
    if count < config.replicas:
        raise ValueError(f"--replicas {config.replicas} needs one GPU per worker and {count} are visible; "
                         "use fewer replicas or --device cpu")
    return config.replicas

