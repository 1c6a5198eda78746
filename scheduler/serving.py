"""The background step loop: thread-safe submission, delta fan-out, blocking and async waits.

The loop thread is the only caller of ``Engine.step()`` while it runs. Other threads talk to
it through the engine's inbox (add / abort / call) and receive deltas through listeners, so
an HTTP event loop never waits on a model step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from radixserve.scheduler.req import GenerateResult, StreamDelta

if TYPE_CHECKING:
    from radixserve.scheduler.engine import Engine

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._listeners: dict[str, Callable[[StreamDelta], None]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def on_loop_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def listen(self, rid: str, callback: Callable[[StreamDelta], None]) -> None:
        """Register before the request is queued (called under the engine's lock)."""
        self._listeners[rid] = callback

    def is_listening(self, rid: str) -> bool:
        return rid in self._listeners

    def start(self) -> None:
        with self.engine._cv:
            if self.running:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="radixserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self.engine._cv:
            self._stopping = True
            self.engine._cv.notify_all()
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

        with self.engine._cv:
            self.engine._inbox.append(("call", wrapped))
            self.engine._cv.notify_all()
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
            with engine._cv:
                while not self._stopping and not engine._inbox and not engine.planner.waiting \
                        and not engine.planner.running:
                    engine._cv.wait()
                if self._stopping:
                    break
            try:
                deltas = engine.step()
            except Exception:  # keep serving: fail what was in flight, not the process
                logger.exception("engine step failed; aborting in-flight requests")
                deltas = engine._abort_all("internal error in the engine step")
            self._dispatch(deltas)
        # Requests still queued or running when the loop stops end as aborted, never silently.
        # Under the lock, so no request slips in between the drain and the thread's exit.
        with engine._cv:
            deltas = engine._drain_inbox() + engine._abort_all("engine shut down")
        self._dispatch(deltas)

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
