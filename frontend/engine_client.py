"""The HTTP side of the engine: admission (429/503), prompt checks, and merged delta streams.

The engine loop runs in its own thread (Engine.generate_stream); this module only awaits the
deltas it hands over, so a slow client never stalls a model step. Each engine request is
counted from admission until its final delta; the sum is held against
max_running_requests + max_queued_requests.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from radixserve.frontend.config import ServerConfig
from radixserve.frontend.errors import APIError, bad_request
from radixserve.frontend.metrics import ServerMetrics
from radixserve.scheduler.req import GenerateResult, StreamDelta
from radixserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


@dataclass
class Job:
    """One engine request of an HTTP request (a choice of `n`, or one prompt of a batch)."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str


class EngineClient:
    def __init__(self, engine: Any, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.max_running = engine.config.max_running_requests
        self.capacity = self.max_running + config.max_queued_requests
        self.num_in_flight = 0  # engine requests admitted here and not finished
        self.draining = False
        self.context_length: int = engine.context_length
        self.vocab_size: int = engine.model_config.vocab_size
        self.total_slots: int = engine.stats()["total_slots"]
        self.page_size: int = engine.config.page_size
        self._idle = asyncio.Event()
        self._idle.set()

    # -- checks ---------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise bad_request("the prompt is empty", param)
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)

    def default_max_tokens(self, prompt_len: int, cap: int, param: str) -> int:
        """Until the end of the context (and KV pool), capped by `cap`; 400 if there is no room at all."""
        pool_room = (self.total_slots // self.page_size) * self.page_size - prompt_len
        room = min(self.context_length - prompt_len, pool_room)
        if room < 1:
            raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room to generate in the context "
                              f"length {self.context_length} and KV cache of {self.total_slots} slots", param,
                              code="context_length_exceeded")
        return min(cap, room)

    def check_max_tokens(self, prompt_len: int, max_tokens: int, param: str) -> None:
        total = prompt_len + max_tokens
        if total > self.context_length:
            raise bad_request(f"the prompt has {prompt_len} tokens and {param} is {max_tokens}: {total} exceeds "
                              f"the context length {self.context_length}", param, code="context_length_exceeded")
        if -(-total // self.page_size) * self.page_size > self.total_slots:  # whole pages
            raise bad_request(f"the prompt has {prompt_len} tokens and {param} is {max_tokens}: {total} tokens "
                              f"exceed the KV cache of {self.total_slots} slots", param)

    # -- admission ------------------------------------------------------------------------

    def reserve(self, num: int) -> "Lease":
        """Admit `num` engine requests or raise 503 (draining), 429 (full) or 400 (never fits)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if num > self.capacity:
            raise bad_request(f"the request asks for {num} generations but the server admits at most "
                              f"{self.capacity} at once", "n")
        if self.num_in_flight + num > self.capacity:
            raise APIError(429, f"the server is at capacity ({self.num_in_flight} requests queued or running); "
                           f"retry later", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += num
        self._idle.clear()
        return Lease(self, num)

    def _release(self, num: int) -> None:
        self.num_in_flight -= num
        if self.num_in_flight <= 0:
            self.num_in_flight = 0
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- generation -----------------------------------------------------------------------

    async def stream(self, jobs: list[Job], lease: "Lease") -> AsyncIterator[tuple[int, StreamDelta]]:
        """Deltas of all jobs as they come, tagged with the job's index.

        Closing the iterator early (client disconnect, error) aborts every unfinished job.
        """
        queue: asyncio.Queue[tuple[int, StreamDelta | BaseException]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(i, job, queue, lease)) for i, job in enumerate(jobs)]
        num_open = len(jobs)
        try:
            while num_open:
                idx, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    num_open -= 1
                yield idx, item
        finally:
            for task in tasks:
                task.cancel()  # generate_stream's own cleanup aborts the engine request
            await asyncio.gather(*tasks, return_exceptions=True)
            lease.close()

    async def generate(self, jobs: list[Job], lease: "Lease") -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(jobs)
        async for idx, delta in self.stream(jobs, lease):
            if delta.finished:
                results[idx] = delta.result
        return [r for r in results if r is not None]

    async def _pump(self, idx: int, job: Job, queue: asyncio.Queue, lease: "Lease") -> None:
        released = False
        try:
            async for delta in self.engine.generate_stream(job.prompt_ids, job.params, rid=job.rid):
                if delta.finished:
                    released = True
                    lease.release_one()
                    self._observe(delta.result)
                queue.put_nowait((idx, delta))
        except ValueError as exc:  # the engine refused the request (checks here normally catch it first)
            queue.put_nowait((idx, bad_request(str(exc))))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine failure ends this request, never the server
            logger.exception("request %s failed", job.rid)
            queue.put_nowait((idx, APIError(500, f"internal error: {exc}")))
        finally:
            if not released:
                lease.release_one()

    def _observe(self, result: GenerateResult | None) -> None:
        if result is not None:
            self.metrics.observe_result(result.ttft_s, result.e2e_s, result.completion_tokens,
                                        result.finish_reason)


class Lease:
    """Admitted engine requests of one HTTP request; each is given back once (close() is idempotent)."""

    def __init__(self, client: EngineClient, num: int) -> None:
        self._client = client
        self._num_held = num

    def release_one(self) -> None:
        if self._num_held > 0:
            self._num_held -= 1
            self._client._release(1)

    def close(self) -> None:
        if self._num_held > 0:
            self._client._release(self._num_held)
            self._num_held = 0
