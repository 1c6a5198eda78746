"""Run the server: start the engine process, serve with uvicorn, drain on SIGTERM, exit 0.

SIGTERM (or a first Ctrl+C): new requests get 503 while admitted ones finish (up to
graceful_timeout_s); then uvicorn stops and the engine process is shut down. A second signal
forces exit. If the engine process dies, open streams end with an error, /health answers 503
and the server exits with status 1 (so a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Any

import uvicorn

from radixserve.frontend import preflight
from radixserve.frontend.config import ServerConfig
from radixserve.frontend.engine_proc import EngineProcess
from radixserve.frontend.server import build_app, build_state
from radixserve.frontend.state import ServerState

logger = logging.getLogger("radixserve.frontend")

ENGINE_DEATH_EXIT_S = 2.0  # after the engine died: time for open streams to get their error event


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.engine_died = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.state.engine.attach(self._loop, self._on_engine_death)
        await super().startup(sockets=sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("radixserve ready: serving %s on http://%s:%d", self.state.model_name, host, port)

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
        # process with -SIGTERM instead of exit status 0.
        if self.state.client.draining or self._loop is None:
            logger.warning("second signal: exiting now")
            self.should_exit = True
            self.force_exit = True
            return
        self.state.client.draining = True
        logger.warning("received %s: refusing new requests, finishing %d running",
                       signal.Signals(sig).name, self.state.client.num_in_flight)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        timeout = self.state.config.graceful_timeout_s
        if not await self.state.client.wait_idle(timeout):
            logger.warning("requests still running after %.0fs; stopping anyway", timeout)
        self.should_exit = True


def run_server(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (0 after a clean drain, 1 if the
    engine process died). Configuration mistakes raise ValueError before the model loads.
    With config.replicas > 1, frontend/replicas.py runs that many of these behind sglang-router."""
    _configure_logging(config.log_level)
    if config.replicas > 1:
        from radixserve.frontend.replicas import run_replicas

        return run_replicas(config)
    preflight.check_before_load(config)
    sock = preflight.bind_listen_socket(config.host, config.port)
    try:
        engine = EngineProcess(config.model, config.engine_kwargs(), log_level=config.log_level)
    except BaseException:
        sock.close()
        raise
    state = build_state(engine, config)
    uv_config = uvicorn.Config(
        build_app(state), host=config.host, port=config.port, lifespan="off", access_log=False,
        log_config=None, log_level="debug" if config.log_level == "debug" else "warning",
        timeout_graceful_shutdown=max(1, int(config.graceful_timeout_s)),
        timeout_keep_alive=5,
    )
    server = DrainingServer(uv_config, state)
    try:
        server.run(sockets=[sock])
    finally:
        # After a forced exit (second signal, dead engine) nothing waits for the engine.
        code = engine.close(timeout=2 if server.force_exit else config.graceful_timeout_s + 5)
        sock.close()
    if server.engine_died:
        logger.error("the engine process died (exit code %s)", code)
        return 1
    if not server.started:
        logger.error("the server did not start")
        return 1
    logger.warning("radixserve stopped")
    return 0


def _configure_logging(level: str) -> None:
    # uvicorn's own start-up chatter stays below the one "ready" line unless debugging (see log_level above).
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
