"""The HTTP process's handle on the engine process (ARCHITECTURE §2). Torch-free.

`EngineProcess` spawns `scheduler.engine_process.engine_main`, binds two ZMQ `ipc://` sockets in
a private temporary directory (never TCP) and waits for the engine's Ready. Once the server's
event loop runs, a reader thread receives the engine's batched `EngineEvents` (one per engine
step) and hands each batch to the loop in one call; the loop routes deltas to the requests'
queues. Everything else (sending, routing, futures) happens on the event loop thread.

If the engine process dies, every open request gets `EngineDead`, new ones are refused, and
`on_death` tells the server to exit non-zero.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from typing import Any, Callable

import zmq

from .structured import warn_if_off
from ..scheduler import messages as msg
from ..scheduler.engine_process import engine_main, socket_paths
from ..scheduler.errors import RequestError
from ..scheduler.sampling_params import SamplingParams, choice_rids
from ..scheduler.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

READER_POLL_MS = 100  # how often the reader checks that the engine process is alive


class EngineDead(RuntimeError):
    """The engine process is gone (crashed, killed, or shut down)."""


class EngineProcess:
    def __init__(self, model: str | None, engine_kwargs: dict[str, Any], log_level: str = "info",
                 env: dict[str, str] | None = None, tenants: dict[str, dict[str, Any]] | None = None) -> None:
        """`tenants`: the tenants' scheduling settings the engine applies at start (Tenants.engine_settings)."""
        self._dir = tempfile.mkdtemp(prefix="radixserve-ipc-")  # mode 0700: only this user
        self._ctx = zmq.Context()
        requests_addr, events_addr = socket_paths(self._dir)
        self._requests = self._ctx.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.SNDHWM, 0)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.bind(requests_addr)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.bind(events_addr)
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: torch loads only there
        self.proc = spawn.Process(target=engine_main, args=(model, engine_kwargs, self._dir, log_level, tenants),
                                  name="radixserve-engine", daemon=True)
        self.proc.start()
        self.dead = False
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_death: Callable[[int | None], None] | None = None
        self._routes: dict[str, tuple[asyncio.Queue, int]] = {}  # rid -> (queue, job index)
        self._admissions: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.num_steps = 0
        self.tenant_slots: dict[str, int] = {}  # KV slots each tenant's running requests held after the last step
        self.num_messages = 0  # EngineEvents received (one per engine step at most, plus admissions)
        self.last_progress = time.monotonic()
        try:
            self.info: msg.EngineInfo = self._wait_ready()
            self.tokenizer = Tokenizer(self.info.model_path)  # this process's own, for prompts and chat
        except BaseException:
            self.close(timeout=5)
            raise

    @property
    def model_path(self) -> str:
        return self.info.model_path

    # -- start and stop ---------------------------------------------------------------------

    def _wait_ready(self) -> msg.EngineInfo:
        while True:
            if self._events.poll(200):
                reply = msg.loads(self._events.recv())
                if isinstance(reply, msg.Ready):
                    logger.info("engine process %d ready", reply.info.pid)
                    warn_if_off(reply.info.structured)
                    return reply.info
                if isinstance(reply, msg.LoadFailed):
                    raise ValueError(reply.message)
            elif not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.proc.exitcode} while loading "
                                   "(see its log above)")

    def attach(self, loop: asyncio.AbstractEventLoop, on_death: Callable[[int | None], None]) -> None:
        """Start delivering the engine's events to `loop` (call from inside it, once)."""
        self._loop = loop
        self._on_death = on_death
        threading.Thread(target=self._read, name="radixserve-engine-events", daemon=True).start()

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask the engine to finish, wait for it (then kill it), and remove the sockets."""
        self._closing = True
        if self.proc.is_alive():
            try:
                self._requests.send(msg.dumps(msg.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("the engine process did not stop in %.0fs; killing it", timeout)
                self.proc.kill()
                self.proc.join(5)
        self._requests.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.proc.exitcode

    # -- requests (event loop thread) -------------------------------------------------------

    async def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, queue: asyncio.Queue,
                  index: int, n: int = 1) -> None:
        """Queue one request in the engine: `n` choices of one prompt (the prompt sent once), named and seeded by
        sampling_params.choice_rids / choice_seed; choice i's deltas go to `queue` as (index + i, delta). Raises
        RequestError if the engine refuses it or one of its ids is open already, EngineDead if there is no engine."""
        self._check_alive()
        rids = choice_rids(rid, n)
        taken = next((r for r in [rid, *rids] if r in self._routes or r in self._admissions), None)
        if taken is not None:  # checked here, before its routes are registered: the open request keeps its own
            raise RequestError(f"request id {taken!r} is already in use", "rid")
        if not self._routes:
            self.last_progress = time.monotonic()  # the watchdog counts from when work arrives
        future = asyncio.get_running_loop().create_future()
        self._admissions[rid] = future
        for i, choice in enumerate(rids):
            self._routes[choice] = (queue, index + i)
        self._send(msg.AddRequest(rid, prompt_ids, params, n))
        try:
            await future
        except BaseException as exc:
            for choice in rids:
                self._routes.pop(choice, None)
            self._admissions.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError) and not self.dead:
                with contextlib.suppress(EngineDead):  # admitted later (a grammar compiling), it must not run
                    for choice in rids:
                        self._send(msg.AbortRequest(choice))
            raise

    def abort(self, rid: str) -> None:
        """Abort a request (no-op if it is finished or unknown); its final delta still arrives
        (finish_reason "abort") and ends its route. If the engine is gone, its death ends the route instead."""
        if rid in self._routes and not self.dead:
            with contextlib.suppress(EngineDead):
                self._send(msg.AbortRequest(rid))

    def open_rids(self) -> list[str]:
        return list(self._routes)

    async def call(self, name: str, timeout: float | None = 60.0, args: tuple = ()) -> Any:
        """Run `name` (stats, flush_cache, check_integrity, open_session, close_session) with `args` in the engine
        between steps."""
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(msg.Call(call_id, name, args))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._calls.pop(call_id, None)

    def stalled(self, timeout_s: float) -> bool:
        """Work is open but the engine reported no progress for `timeout_s` seconds."""
        return bool(self._routes) and time.monotonic() - self.last_progress > timeout_s

    def _check_alive(self) -> None:
        if self.dead or self._closing:
            raise EngineDead("the engine process is not running")

    def _send(self, message: Any) -> None:
        """Never blocks the event loop: a PUSH socket whose peer is gone (the engine died) would wait for one
        forever, and the death would never be noticed. An engine that has exited, or a send that fails, means the
        engine is gone: it is declared dead here (every open request fails) rather than when the reader thread next
        looks. The exit is checked first: until zmq's I/O thread has seen the peer's socket close, a send to a
        dead engine still succeeds, into a queue nobody reads."""
        if self.proc.is_alive():
            try:
                self._requests.send(msg.dumps(message), zmq.NOBLOCK)
                return
            except zmq.Again:
                self.proc.join(1.0)  # the engine's end closed its socket; its exit status is a moment behind
        self._died()
        raise EngineDead("the engine process is not reading requests")

    # -- events (reader thread -> event loop) -----------------------------------------------

    def _read(self) -> None:
        assert self._loop is not None
        while True:
            try:
                ready = self._events.poll(READER_POLL_MS)
                batch = []
                while ready:
                    try:
                        batch.append(msg.loads(self._events.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            except zmq.ZMQError:  # the socket was closed: the server is stopping
                return
            try:
                if batch:
                    self._loop.call_soon_threadsafe(self._dispatch, batch)
                elif not self.proc.is_alive():
                    if not self._closing:
                        self._loop.call_soon_threadsafe(self._died)
                    return
            except RuntimeError:  # the event loop is closed: the server has stopped
                return

    def _dispatch(self, batch: list[Any]) -> None:
        for events in batch:
            if not isinstance(events, msg.EngineEvents):
                continue
            self.last_progress = time.monotonic()
            self.num_steps = events.num_steps
            if events.tenant_slots is not None:
                self.tenant_slots = events.tenant_slots
            self.num_messages += 1
            for rid in events.accepted:
                _resolve(self._admissions.pop(rid, None), None)
            for rej in events.rejected:
                _fail(self._admissions.pop(rej.rid, None), RequestError(rej.message, rej.param, rej.code))
                self._routes.pop(rej.rid, None)
            for reply in events.replies:
                future = self._calls.pop(reply.call_id, None)
                if reply.error is not None:
                    _fail(future, RuntimeError(reply.error))
                else:
                    _resolve(future, reply.value)
            for delta in events.deltas:
                route = self._routes.pop(delta.rid, None) if delta.finished else self._routes.get(delta.rid)
                if route is not None:
                    route[0].put_nowait((route[1], delta))

    def fail_open(self, error: BaseException) -> None:
        """End every open request with `error` (event loop thread): a stream gets it as its next item, an
        admission or engine call raises it. Their later deltas are dropped."""
        for queue, index in self._routes.values():
            queue.put_nowait((index, error))
        for future in list(self._admissions.values()) + list(self._calls.values()):
            _fail(future, error)
        self._routes.clear()
        self._admissions.clear()
        self._calls.clear()

    def _died(self) -> None:
        if self.dead:  # _send and the reader thread may both see the death
            return
        code = self.proc.exitcode
        self.dead = True
        logger.error("the engine process died (exit code %s); failing %d open request(s)", code, len(self._routes))
        self.fail_open(EngineDead(f"the engine process died (exit code {code})"))
        if self._on_death is not None:
            self._on_death(code)


def _resolve(future: asyncio.Future | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future | None, error: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(error)
