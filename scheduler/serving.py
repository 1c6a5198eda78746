"""The background step loop: one thread steps the engine; other threads submit, abort and call through its inbox
and receive deltas through listeners, so an HTTP event loop never waits on a model step.

The loop is a transport over the engine's driver API (add / abort / step / abort_all, scheduler/engine.py); it owns
the only lock and inbox the threaded mode needs. The engine process (scheduler/engine_process.py) is the other
transport and steps the engine on its own single thread, with neither.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from .req import GenerateResult, Req, StreamDelta

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._listeners: dict[str, Callable[[StreamDelta], None] | None] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def on_loop_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def submit(self, reqs: list[Req], on_delta: Callable[[StreamDelta], None] | None) -> None:
        """Queue built requests (all or none): for the loop's thread while it runs, else into the engine at once
        (the caller then steps). Raises ValueError on a request id in use (a finished request's listener lives
        until its final delta is dispatched; reusing the id before then would hand that delta to the new
        request's listener)."""
        with self._cv:
            for req in reqs:
                if req.rid in self._listeners or self.engine.has_request(req.rid):
                    raise ValueError(f"request id {req.rid!r} is already in use")
            for req in reqs:
                if self.running and not self.on_loop_thread():
                    self._inbox.append(("add", req))
                else:
                    self.engine.admit(req)
                if on_delta is not None or self.running:
                    self._listeners[req.rid] = on_delta
            self._cv.notify_all()

    def queue_abort(self, rid: str) -> bool:
        """Queue an abort for the loop's thread; False when the caller should abort directly (no loop running, or
        the caller is the loop's thread)."""
        with self._cv:
            if not self.running or self.on_loop_thread():
                return False
            self._inbox.append(("abort", rid))
            self._cv.notify_all()
            return True

    def start(self) -> None:
        with self._cv:
            if self.running:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the loop thread between steps and return its result."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def wrapped() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc
            finally:
                done.set()

        with self._cv:
            self._inbox.append(("call", wrapped))
            self._cv.notify_all()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def generate_blocking(self, prompts: list, params_list: list) -> list[GenerateResult]:
        results: dict[str, GenerateResult] = {}
        all_done = threading.Event()
        lock = threading.Lock()
        rids: list[str] = []

        def on_delta(delta: StreamDelta) -> None:
            if delta.finished and delta.result is not None:
                with lock:
                    results[delta.rid] = delta.result
                    if len(results) == len(prompts):
                        all_done.set()

        for prompt, params in zip(prompts, params_list):
            rids.append(self.engine.add_request(prompt, params, on_delta=on_delta))
        all_done.wait()
        return [results[r] for r in rids]

    async def stream(self, prompt: Any, params: Any, rid: str | None) -> AsyncIterator[StreamDelta]:
        self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        rid = self.engine.add_request(prompt, params, rid=rid,
                                      on_delta=lambda d: loop.call_soon_threadsafe(queue.put_nowait, d))
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # the consumer went away (e.g. client disconnect): free the KV
                self.engine.abort(rid)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._stopping and not self._inbox and not engine.has_unfinished():
                    self._cv.wait()
                if self._stopping:
                    break
                commands, self._inbox = self._inbox, []
            self._apply(commands)
            self._dispatch(engine.step())  # a step's failure is caught inside it: its requests end aborted
        # Requests still queued or running when the loop stops end as aborted, never silently.
        # Under the lock, so no request slips in between the drain and the thread's exit.
        with self._cv:
            commands, self._inbox = self._inbox, []
            self._apply(commands)
            self._dispatch(engine.abort_all("engine shut down"))

    def _apply(self, commands: list[tuple[str, Any]]) -> None:
        for kind, arg in commands:
            if kind == "add":
                self.engine.admit(arg)
            elif kind == "abort":
                self.engine.abort(arg)
            else:
                arg()

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            callback = self._listeners.get(delta.rid)
            if delta.finished:
                self._listeners.pop(delta.rid, None)
            if callback is not None:
                try:
                    callback(delta)
                except Exception:
                    logger.exception("delta listener for %s failed", delta.rid)
