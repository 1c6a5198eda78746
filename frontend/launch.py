"""Run the server: start the engine process, serve with uvicorn, drain on the first signal, stop on the second.

The first SIGTERM or Ctrl-C (SIGINT) logs "draining N requests (up to S s); Ctrl-C again to stop
now": new requests get 503 while admitted ones finish (up to graceful_timeout_s); then uvicorn
stops, the engine process is shut down and the exit status is 0. Requests still running when that
time runs out end as below, and the status stays 0 (the stop was asked for).

A second signal stops now: every open request ends with an OpenAI error (503, code
server_shutting_down; a stream gets it as its last event), the engine process is stopped, and the
process exits with 128 + the signal's number, as a shell reports a process that signal ended: 130
for SIGINT, 143 for SIGTERM. A signal while the model loads stops at once, with the same status.

If the engine process dies, open streams end with an error, /health answers 503 and the server
exits with status 1 (so a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from types import FrameType
from typing import Any, Callable, Iterator

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from . import preflight
from .config import ServerConfig
from .engine_proc import EngineProcess
from .errors import APIError
from .server import build_app, build_state
from .state import ServerState
from .tenants import Tenants

logger = logging.getLogger("radixserve.frontend")

ENGINE_DEATH_EXIT_S = 2.0  # after the engine died: time for open streams to get their error event
FLUSH_S = 2.0  # after open requests were ended with an error: time for their last bytes to go out
SIGNALS = (signal.SIGINT, signal.SIGTERM)
GC_TICK_S = 0.25  # how often a full collection is considered (scheduler/gc_freeze.FullPasses)
# HTTP/2 prior knowledge (RFC 9113 3.4) starts with this line; the answer is the server's connection
# preface (an empty SETTINGS frame) and a GOAWAY with error HTTP_1_1_REQUIRED: "ask again in HTTP/1.1".
H2_PREFACE = b"PRI * HTTP/2.0\r\n"
H2_REFUSAL = bytes.fromhex("000000" "04" "00" "00000000" "000008" "07" "00" "00000000" "00000000" "0000000d")


class Http1Only(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP/1.1 protocol, which answers an HTTP/2 prior-knowledge connection with HTTP/2's
    own refusal. sglang-router opens two on every worker it registers, probing for a gRPC server
    beside its HTTP check; parsed as HTTP/1.1 each made a `"PRI *" 404` line and an "Invalid HTTP
    request received" warning."""

    _first_data = True

    def data_received(self, data: bytes) -> None:
        if self._first_data:
            self._first_data = False
            if data.startswith(H2_PREFACE):
                logger.debug("refused an HTTP/2 connection from %s (HTTP/1.1 only)",
                             self.transport.get_extra_info("peername"))
                self.transport.write(H2_REFUSAL)
                self.transport.close()
                return
        super().data_received(data)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains and whose second stops now (see the module doc)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.engine_died = False
        self.stop_signal: int | None = None  # the signal that stopped the server without waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # run_server routes the signals to handle_exit for the whole run, the engine's shutdown included

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.state.engine.attach(self._loop, self._on_engine_death)
        await super().startup(sockets=sockets)
        self.state.gc.install()  # torch, the tokenizer, the app frozen; full collections when nothing is in flight
        self._tasks.add(asyncio.ensure_future(self._collect_when_quiet()))
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("radixserve ready: serving %s on http://%s:%d (attention: %s)", self.state.model_name,
                        host, port, self.state.engine.info.attention)

    async def _collect_when_quiet(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(GC_TICK_S)
            self.state.gc.tick(quiet=self.state.client.num_in_flight == 0)

    def _on_engine_death(self, code: int | None) -> None:
        self.engine_died = True
        self.state.client.draining = True
        assert self._loop is not None
        self._loop.call_later(ENGINE_DEATH_EXIT_S, self._exit_now)

    def _exit_now(self) -> None:
        logger.error("exiting: the engine process is gone")
        self.should_exit = True
        self.force_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not calling super(): uvicorn would re-raise the signal after shutdown, ending the
        # process by the signal instead of with our exit status.
        name = signal.Signals(sig).name
        if self._loop is None or self._loop.is_closed():  # uvicorn is done; the engine is closing
            logger.warning("received %s: stopping the engine now", name)
            self.stop_signal = sig
            self.should_exit = self.force_exit = True  # in case uvicorn has not started yet
            self.state.engine.proc.kill()
        elif self.stop_signal is not None:
            self.should_exit = self.force_exit = True
        elif self.state.client.draining:
            self.stop_signal = sig
            logger.warning("received %s while draining: stopping now, ending %s with an error", name,
                           _requests(self.state.client.num_in_flight))
            self._soon(self._end_open_requests, "a second shutdown signal")
        else:
            self.state.client.draining = True
            logger.warning("received %s: draining %s (up to %g s); Ctrl-C again to stop now", name,
                           _requests(self.state.client.num_in_flight), self.state.config.graceful_timeout_s)
            self._soon(self._drain)

    def _soon(self, coro: Callable[..., Any], *args: Any) -> None:
        """Run coro(*args) on the event loop (signal handlers run between its callbacks)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lambda: self._tasks.add(asyncio.ensure_future(coro(*args))))

    async def _drain(self) -> None:
        timeout = self.state.config.graceful_timeout_s
        if not await self.state.client.wait_idle(timeout):
            logger.warning("requests still running after %g s; stopping anyway", timeout)
            await self._end_open_requests(f"--graceful-timeout {timeout:g} s ran out")
        self.should_exit = True

    async def _end_open_requests(self, why: str) -> None:
        """Each open request gets a 503 (a stream: its error event); their last bytes go out, then uvicorn
        stops without waiting more, and so does the engine process (engine.close)."""
        error = APIError(503, f"the server stopped before this request finished ({why})", code="server_shutting_down")
        self.state.engine.fail_open(error)
        deadline = time.monotonic() + FLUSH_S
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = self.force_exit = True


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


def run_server(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (0 after a drain, 128 + the signal after a
    second one, 1 if the engine process died). Configuration mistakes raise ValueError before the model
    loads. With config.replicas > 1, frontend/replicas.py runs that many of these behind sglang-router."""
    _configure_logging(config.log_level)
    if config.replicas > 1:
        from .replicas import run_replicas

        return run_replicas(config)
    preflight.check_before_load(config)
    sock = preflight.bind_listen_socket(config.host, config.port)
    with _signals_restored():
        _route_signals(_interrupt)
        engine: EngineProcess | None = None
        try:
            tenants = Tenants.from_config(config.api_key, config.api_keys)
            engine = EngineProcess(config.model, config.engine_kwargs(), log_level=config.log_level,
                                   tenants=tenants.engine_settings())
            state = build_state(engine, config, tenants)
        except BaseException as exc:
            sock.close()
            if engine is not None:
                engine.close(timeout=2)
            if not isinstance(exc, _Interrupted):
                raise
            logger.warning("received %s while the model was loading: stopped", signal.Signals(exc.sig).name)
            return 128 + exc.sig
        return _serve(config, state, sock)


def _serve(config: ServerConfig, state: ServerState, sock: Any) -> int:
    uv_config = uvicorn.Config(
        build_app(state), host=config.host, port=config.port, lifespan="off", access_log=False,
        log_config=None, log_level="debug" if config.log_level == "debug" else "warning",
        timeout_graceful_shutdown=max(1, int(config.graceful_timeout_s)),
        timeout_keep_alive=config.keep_alive_s, http=Http1Only,
    )
    server = DrainingServer(uv_config, state)
    _route_signals(server.handle_exit)
    try:
        server.run(sockets=[sock])
    finally:
        # After a forced exit (requests ended with an error, dead engine) nothing waits for the engine.
        code = state.engine.close(timeout=2 if server.force_exit else config.graceful_timeout_s + 5)
        sock.close()
    return _exit_status(server, code)


def _exit_status(server: DrainingServer, engine_code: int | None) -> int:
    if server.stop_signal is not None:
        logger.warning("radixserve stopped by %s", signal.Signals(server.stop_signal).name)
        return 128 + server.stop_signal
    if server.engine_died:
        logger.error("the engine process died (exit code %s)", engine_code)
        return 1
    if not server.started:
        logger.error("the server did not start")
        return 1
    logger.warning("radixserve stopped")
    return 0


class _Interrupted(Exception):
    """A signal while the model loads, raised by the signal handler."""

    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.sig = sig


def _interrupt(sig: int, frame: FrameType | None) -> None:
    raise _Interrupted(sig)


def _route_signals(handler: Callable[[int, FrameType | None], None]) -> None:
    for sig in SIGNALS:
        signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _configure_logging(level: str) -> None:
    # uvicorn's own start-up chatter stays below the one "ready" line unless debugging (see log_level above).
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
