"""Start `radixserve serve` in a subprocess and wait for its "ready" line (tests and benchmarks).

The server is started with --port 0 unless told otherwise; the OS picks a free port and the
ready line says which, so concurrent test runs never race for a port.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

READY = re.compile(r"radixserve ready: serving .* on (http://[\d.]+:\d+)")


class ServerProcess:
    def __init__(self, args: list[str], start_timeout_s: float = 300.0, env: dict[str, str] | None = None,
                 python: str = sys.executable) -> None:
        """`python`: the interpreter to serve with (another venv's, to test an install other than this one)."""
        full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **(env or {}))
        cmd = [python, "-m", "radixserve.frontend.cli", "serve", "--host", "127.0.0.1", "--port", "0",
               "--log-level", "info", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=full_env)
        self.lines: list[str] = []
        self.url = ""
        self._ready = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._ready.wait(start_timeout_s) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + self.log())

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # drained continuously so the pipe never blocks the server
            self.lines.append(line)
            match = READY.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # the process ended (maybe before becoming ready)

    def log(self) -> str:
        return "".join(self.lines)

    def client(self, **kwargs) -> "httpx.Client":
        import httpx  # a test / bench dependency; `serve --replicas` imports this module without it

        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 120.0), **kwargs)

    def server_info(self, headers: dict | None = None) -> dict:
        import httpx

        return httpx.get(self.url + "/get_server_info", headers=headers, timeout=30).json()

    def wait_idle(self, headers: dict | None = None, timeout: float = 30.0) -> dict:
        """Server info once nothing is in flight at the HTTP layer or in the engine."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info(headers)
            stats = info["stats"]
            if info["num_in_flight"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {info}")
            time.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain), then kill after `timeout`; returns the exit status."""
        return stop_process(self.proc, timeout)


def stop_process(proc: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
