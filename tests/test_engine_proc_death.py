"""frontend/engine_proc.py when the engine process is gone before the server has noticed: sending to it must
fail at once with EngineDead, never block the event loop (a PUSH socket with no peer waits for one forever; the
soak found a worker whose loop hung there after its engine was killed under load, so it never exited)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve.frontend.engine_proc import EngineDead, EngineProcess
from radixserve.scheduler.sampling_params import SamplingParams


def test_a_request_to_a_dead_engine_fails_instead_of_blocking():
    engine = EngineProcess(None, {"num_threads": 1})
    try:
        engine.proc.kill()
        engine.proc.join(30)
        # No reader thread is attached, so nothing has told the process about the death: add() reaches the socket.
        outcome: dict[str, BaseException | None] = {}

        def submit() -> None:
            async def add() -> None:
                await engine.add("r1", [1, 2, 3], SamplingParams(max_new_tokens=2), asyncio.Queue(), 0)

            try:
                asyncio.run(add())
                outcome["error"] = None
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                outcome["error"] = exc

        thread = threading.Thread(target=submit, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "add() blocked on a dead engine's socket"
        assert isinstance(outcome["error"], EngineDead)
        assert engine.dead
        engine.abort("r2")  # aborting after the death is a no-op, not an error
        with pytest.raises(EngineDead):
            asyncio.run(engine.call("stats"))
    finally:
        engine.close(timeout=5)
