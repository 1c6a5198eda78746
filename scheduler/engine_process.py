"""The engine process: the scheduler and the model, driven by messages from the HTTP process.

One thread runs a loop (ARCHITECTURE §2):

    receive every waiting message (add / abort / call / shutdown)
    -> queue the adds (the Engine validates them: rejections go back at once; one whose grammar is not
       compiled yet waits for a worker thread first, scheduler/grammar_prep.py)
    -> one Engine.step() when there is work
    -> send ONE EngineEvents with the step's admissions, replies and deltas

Text is decoded once, here (each request's IncrementalDetokenizer, which stop strings need).
The process exits when told to, when the HTTP process (its parent) goes away, or on a fatal
error; the HTTP side notices a dead engine by its exit and fails what was in flight.

A test-only fault switch, the RADIXSERVE_TEST_FAULT environment variable, makes the failure
states reproducible: "fail-forward" makes every forward raise, "hang-forward" makes the first
forward block forever, "slow-grammar" makes every grammar compile (a cache miss) sleep 3 s first.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import zmq

from . import messages as msg
from .errors import RequestError
from .gc_freeze import FullPasses
from .grammar import xgrammar_installed
from .grammar_prep import PendingGrammars

logger = logging.getLogger(__name__)

FAULT_ENV = "RADIXSERVE_TEST_FAULT"
FAULTS = ("fail-forward", "hang-forward", "slow-grammar")
IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is alive
PENDING_POLL_MS = 5  # how often an otherwise idle engine looks for a finished grammar
PROGRESS_EVERY_S = 0.5  # a busy engine reports progress at least this often, even without deltas


def socket_paths(ipc_dir: str) -> tuple[str, str]:
    """(requests: HTTP -> engine, events: engine -> HTTP) endpoints in the private directory."""
    return f"ipc://{os.path.join(ipc_dir, 'requests')}", f"ipc://{os.path.join(ipc_dir, 'events')}"


def engine_main(model: str | None, engine_kwargs: dict[str, Any], ipc_dir: str, log_level: str,
                tenants: dict[str, dict[str, Any]] | None = None) -> None:
    """Entry point of the spawned engine process; `tenants`: Engine.set_tenants's settings (the keys file's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the process group: the HTTP side decides
    _die_with_parent()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    requests_addr, events_addr = socket_paths(ipc_dir)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(requests_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(events_addr)
    try:
        engine = _load(model, engine_kwargs, outbox, tenants or {})
        if engine is not None:
            EngineServer(engine, inbox, outbox, parent).run()
    finally:
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


def _load(model: str | None, engine_kwargs: dict[str, Any], outbox: zmq.Socket, tenants: dict[str, dict[str, Any]]):
    from .engine import Engine

    try:
        engine = Engine(model, **engine_kwargs)
        engine.set_tenants(tenants)
        _install_fault(engine, os.environ.get(FAULT_ENV, ""))
    except ValueError as exc:  # a bad checkpoint or setting: one line for the user
        outbox.send(msg.dumps(msg.LoadFailed(str(exc).splitlines()[0] if str(exc) else repr(exc))))
        return None
    except Exception as exc:
        logger.exception("the engine failed to load")
        outbox.send(msg.dumps(msg.LoadFailed(f"the engine failed to load: {exc!r}")))
        return None
    cfg = engine.config
    info = msg.EngineInfo(model_path=engine.model_path, context_length=engine.context_length,
                          vocab_size=engine.model_config.vocab_size, total_slots=engine.kv.total_slots,
                          page_size=cfg.page_size, max_running_requests=cfg.max_running_requests,
                          engine_config=_config_dict(cfg), pid=os.getpid(), attention=engine.runner.attention,
                          structured=xgrammar_installed())
    outbox.send(msg.dumps(msg.Ready(info)))
    return engine


def _config_dict(cfg: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(cfg)


class EngineServer:
    """The engine process's loop (single-threaded: the only caller of Engine.step())."""

    def __init__(self, engine: Any, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.stopping = False
        self._last_sent = time.monotonic()
        self._sent_slots: dict[str, int] | None = None
        self.pending = PendingGrammars(engine.grammar)
        self.gc = FullPasses()

    def run(self) -> None:
        self.gc.install()  # the model and torch frozen; full collections between steps, when nothing is left to run
        self._loop()
        gone = [msg.Rejected(m.rid, "the engine shut down") for m in self.pending.drain()]
        self._send(msg.EngineEvents(rejected=gone, deltas=self.engine.abort_all("engine shut down")))

    def _loop(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished()
            events = msg.EngineEvents()
            self._receive(events, wait_ms=0 if busy else PENDING_POLL_MS if self.pending else IDLE_POLL_MS)
            self._admit_prepared(events)
            if events.accepted or events.rejected or events.replies:
                self._send(events)  # admissions first: a rejected request becomes a 400 now
                events = msg.EngineEvents()
            if self.stopping:
                break
            if engine.has_unfinished():
                events.deltas = engine.step()
                events.tenant_slots = engine.tenant_slots()
                # Requests read whole send no deltas until they finish; the KV their tenants hold still reaches the
                # HTTP side's limits (frontend/tenant_limits.py) as it changes.
                moved = events.tenant_slots != self._sent_slots
                if events.deltas or moved or time.monotonic() - self._last_sent >= PROGRESS_EVERY_S:
                    self._sent_slots = events.tenant_slots
                    self._send(events)
            elif os.getppid() != self.parent_pid:
                logger.warning("the HTTP process went away; the engine exits")
                break
            self.gc.tick(quiet=not engine.has_unfinished())

    def _receive(self, events: msg.EngineEvents, wait_ms: int) -> None:
        if not self.inbox.poll(wait_ms):
            return
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(msg.loads(data), events)

    def _handle(self, message: Any, events: msg.EngineEvents) -> None:
        engine = self.engine
        if isinstance(message, msg.AddRequest):
            if not self.pending.hold(message):
                self._admit(message, events)
        elif isinstance(message, msg.AbortRequest):
            if not self.pending.abort(message.rid):
                engine.abort(message.rid)
        elif isinstance(message, msg.Call):
            events.replies.append(self._call(message))
        elif isinstance(message, msg.Shutdown):
            self.stopping = True
        else:
            logger.error("unknown message %r", type(message).__name__)

    def _admit(self, message: msg.AddRequest, events: msg.EngineEvents, error: BaseException | None = None) -> bool:
        try:
            if error is not None:
                raise error
            self.engine.add_choices(message.prompt_ids, message.params, message.n, rid=message.rid)
            events.accepted.append(message.rid)
            return True
        except RequestError as exc:
            events.rejected.append(msg.Rejected(message.rid, exc.message, exc.param, exc.code))
        except ValueError as exc:
            events.rejected.append(msg.Rejected(message.rid, str(exc)))
        return False

    def _admit_prepared(self, events: msg.EngineEvents) -> None:
        """Admit (or reject) the requests whose grammar finished compiling on the worker thread."""
        for message, error, aborted in self.pending.ready():
            if self._admit(message, events, error):
                for rid in aborted:
                    self.engine.abort(rid)

    def _call(self, call: msg.Call) -> msg.Reply:
        calls = {"stats": self._stats, "flush_cache": self.engine.flush_cache,
                 "check_integrity": self.engine.check_integrity, "open_session": self.engine.open_session,
                 "close_session": self.engine.close_session, "settle_session": self.engine.settle_session}
        fn = calls.get(call.name)
        if fn is None:
            return msg.Reply(call.call_id, error=f"unknown call {call.name!r}")
        try:
            return msg.Reply(call.call_id, value=fn(*call.args))
        except Exception as exc:  # e.g. a broken integrity identity: the caller sees it
            return msg.Reply(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _stats(self) -> dict:
        """The engine's stats, with the requests held here while their grammar compiles counted
        as waiting (they are queued work: the router's load and the idle checks must see them)."""
        stats = self.engine.stats()
        stats["num_grammar_pending"] = len(self.pending)
        stats.update(self.gc.stats())
        stats["num_waiting"] += len(self.pending)
        return stats

    def _send(self, events: msg.EngineEvents) -> None:
        events.num_steps = self.engine.step_index
        self.outbox.send(msg.dumps(events))
        self._last_sent = time.monotonic()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the HTTP process dies, even mid-step (the
    idle loop's parent check covers other systems)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _install_fault(engine: Any, fault: str) -> None:
    """The test-only fault switch (see the module docstring)."""
    if not fault:
        return
    if fault not in FAULTS:
        raise ValueError(f"{FAULT_ENV} must be one of {', '.join(FAULTS)}, got {fault!r}")
    logger.warning("test fault switch on: %s", fault)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault: the forward fails")

    def hang(*args: Any, **kwargs: Any) -> Any:
        threading.Event().wait()

    if fault == "slow-grammar":
        compile_uncached = engine.grammar._compile

        def slow(kind: str, text: str) -> Any:
            time.sleep(3.0)
            return compile_uncached(kind, text)

        engine.grammar._compile = slow
        return
    engine.runner.forward = fail if fault == "fail-forward" else hang
