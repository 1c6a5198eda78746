"""The HTTP side of the engine: admission (429/503), submission, and merged delta streams.

The engine runs in its own process (frontend.engine_proc.EngineProcess); this module only
awaits the deltas it routes here, so a slow client never stalls a model step. Each engine
request is counted from admission until its final delta; the sum is held against
max_running_requests + max_queued_requests. Whether a request fits the model is decided once,
by the engine (a RequestError, mapped here to a 400 naming the API's own parameter).
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect, Request

from .config import ServerConfig
from .engine_proc import EngineDead
from .errors import APIError, bad_request
from .metrics import ServerMetrics
from .sse import run_watching_disconnect
from .tenant_limits import TenantLimiter
from .tenants import current as current_tenant, engine_session
from ..scheduler.errors import RequestError
from ..scheduler.req import GenerateResult, StreamDelta
from ..scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


@dataclass
class Job:
    """One engine request of an HTTP request (a choice of `n`, or one prompt of a batch)."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str
    # The engine's parameter names ("prompt", "max_new_tokens") -> the ones the client sent.
    param_names: dict[str, str] = field(default_factory=dict)
    # The choices of one prompt (n > 1) are consecutive jobs with the same group, (engine request id, n): the
    # engine gets them as one request, whose choices it names and seeds as make_jobs did (sampling_params.choice_*).
    group: tuple[str, int] | None = None

    def refusal(self, error: RequestError) -> APIError:
        """The engine's refusal as a 400 in the client's terms: the parameter it sent, named so in the message too
        (identifiers only: "prompt" is also a plain word of the engine's messages)."""
        message = error.message
        for engine_name, api_name in self.param_names.items():
            if "_" in engine_name:
                message = re.sub(rf"\b{engine_name}\b", api_name, message)
        param = self.param_names.get(error.param or "", error.param)
        return bad_request(message, param, code=error.code or "invalid_value")


ENGINE_CALL_TIMEOUT_S = 10.0  # stats / flush between steps; a stuck engine makes them 503, not hang


def engine_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"the engine is not available: {exc}", code="engine_unavailable")


async def engine_call(engine: Any, name: str, args: tuple = ()) -> Any:
    """An engine method run between steps (EngineProcess.call); 503 when there is no engine to ask."""
    try:
        return await engine.call(name, timeout=ENGINE_CALL_TIMEOUT_S, args=args)
    except (EngineDead, asyncio.TimeoutError) as exc:
        raise engine_unavailable(exc if str(exc) else EngineDead("no answer")) from exc


class EngineClient:
    def __init__(self, engine: Any, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine  # an EngineProcess
        self.config = config
        self.metrics = metrics
        info = engine.info
        self.max_running = info.max_running_requests
        self.capacity = self.max_running + config.max_queued_requests
        self.num_in_flight = 0  # engine requests admitted here and not finished
        self.draining = False
        self.context_length: int = info.context_length
        self.vocab_size: int = info.vocab_size
        self.total_slots: int = info.total_slots
        self.page_size: int = info.page_size
        self._idle = asyncio.Event()
        self._idle.set()
        self.limiter = TenantLimiter(engine, self.max_running, config.max_queued_requests, self.total_slots)
        self.owners: dict[str, str] = {}  # open engine request id (a choice's) -> its tenant

    def default_max_tokens(self, prompt_len: int, cap: int, param: str) -> int:
        """Until the end of the context (and KV pool), capped by `cap`; 400 if there is no room at all."""
        pool_room = (self.total_slots // self.page_size) * self.page_size - prompt_len
        room = min(self.context_length - prompt_len, pool_room)
        if room < 1:
            raise bad_request(f"the prompt has {prompt_len} tokens, which leaves no room to generate in the context "
                              f"length {self.context_length} and KV cache of {self.total_slots} slots", param,
                              code="context_length_exceeded")
        return min(cap, room)

    # -- admission ------------------------------------------------------------------------

    def reserve(self, num: int, param: str | None = "n") -> "Lease":
        """Admit `num` engine requests of the current tenant (frontend/tenants.py) or raise 503 (draining, no
        engine), 429 (full, or the tenant over a limit: frontend/tenant_limits.py) or 400 (never fits; naming
        `param`, what made the count: n, or None for a batch of prompts)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if self.engine.dead:
            raise engine_unavailable(EngineDead("the engine process died"))
        if num > self.capacity:
            raise bad_request(f"the request asks for {num} generations but the server admits at most "
                              f"{self.capacity} at once", param)
        if self.num_in_flight + num > self.capacity:
            raise APIError(429, f"the server is at capacity ({self.num_in_flight} requests queued or running); "
                           f"retry later", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        tenant = current_tenant()
        self.limiter.admit(tenant, num, param)
        self.num_in_flight += num
        self._idle.clear()
        return Lease(self, num, tenant.name)

    def _release(self, num: int, tenant: str) -> None:
        self.limiter.release(tenant, num)
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

    async def submit(self, jobs: list[Job], lease: "Lease", request: Request | None = None, *, stream: bool
                     ) -> "Submission":
        """Queue every job in the engine, or none: a refused job is a 400 (an unreachable
        engine a 503) raised before the caller has sent anything; the lease is closed then.
        `stream`: the caller reads every delta (every --stream-interval tokens), else only each job's final one.
        With the HTTP `request`, a client that leaves before every job is admitted (a grammar can
        take seconds to compile) raises ClientDisconnect, and its jobs are aborted: the engine
        drops a held one right after its admission instead of running it."""
        sub = Submission(self, jobs, lease)
        firsts = [i for i, job in enumerate(jobs) if job.group is None or i == 0 or jobs[i - 1].group != job.group]
        interval = self.config.stream_interval if stream else 0
        adds = asyncio.gather(*(self._add(jobs[i], sub.queue, i, lease.tenant, interval) for i in firsts),
                              return_exceptions=True)
        if request is None:
            outcomes = await adds
        else:
            gone, outcomes = await run_watching_disconnect(request, adds)  # cancelled adds send their aborts
            if gone:
                sub.close()
                raise ClientDisconnect()
        error = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if error is None:
            sub.own()
            return sub
        sub.forget(firsts, outcomes)
        sub.close()
        if isinstance(error, RequestError):
            raise jobs[firsts[outcomes.index(error)]].refusal(error) from error
        if isinstance(error, EngineDead):
            raise engine_unavailable(error) from error
        raise error

    def _add(self, job: Job, queue: asyncio.Queue, index: int, tenant: str, stream_interval: int) -> Any:
        """One engine request: a job, or the n choices of a group (whose first job this is). The one place the
        HTTP side hands the engine a request: it is the tenant's (fair share), and so is its session."""
        rid, n = job.group if job.group is not None else (job.rid, 1)
        session = job.params.session_id
        params = replace(job.params, tenant=tenant, stream_interval=stream_interval,
                         session_id=engine_session(session, tenant) if session is not None else None)
        return self.engine.add(rid, job.prompt_ids, params, queue, index, n=n)

    async def generate(self, jobs: list[Job], lease: "Lease") -> list[GenerateResult]:
        """Submit and wait for every result (closing the lease in the end)."""
        sub = await self.submit(jobs, lease, stream=False)
        return await sub.results()

    def abort_matching(self, rid: str | None, tenant: str | None) -> int:
        """Abort the engine requests of HTTP request `rid` (its jobs are rid or rid-...; None: every one), of
        `tenant` only (None: anyone's, an admin's abort)."""
        hits = [r for r in self.engine.open_rids() if (rid is None or r == rid or r.startswith(rid + "-"))
                and (tenant is None or self.owners.get(r) == tenant)]
        for r in hits:
            self.engine.abort(r)
        return len(hits)

    def observe(self, result: GenerateResult | None, tenant: str) -> None:
        if result is not None:
            self.limiter.charge(tenant, result.prompt_tokens + result.completion_tokens)
            self.metrics.observe_result(result.ttft_s, result.e2e_s, result.completion_tokens,
                                        result.finish_reason)
            self.metrics.observe_tenant(tenant, result)


class Submission:
    """The jobs of one HTTP request, queued in the engine: their merged deltas, and an abort
    of whatever is unfinished when it is closed (client gone, error)."""

    def __init__(self, client: EngineClient, jobs: list[Job], lease: "Lease") -> None:
        self.client = client
        self.jobs = jobs
        self.lease = lease
        self.queue: asyncio.Queue[tuple[int, StreamDelta | BaseException]] = asyncio.Queue()
        self._open = [True] * len(jobs)
        self._owned = False

    def own(self) -> None:
        """Every job was admitted: their ids are this submission's (and its tenant's, for /abort_request)."""
        self._owned = True
        self.client.owners.update((job.rid, self.lease.tenant) for job in self.jobs)

    def forget(self, firsts: list[int], outcomes: list[Any]) -> None:
        """The jobs whose engine request failed to be added (outcomes of the groups starting at `firsts`) are not
        open: closing must not abort their ids, which may be another request's (EngineProcess.add refuses an id in
        use)."""
        bounds = firsts + [len(self.jobs)]
        for k, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                for idx in range(bounds[k], bounds[k + 1]):
                    self._open[idx] = False

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(job index, delta) as they come; an engine failure raises a 503 APIError (an APIError put in
        by EngineProcess.fail_open as it is)."""
        try:
            while any(self._open):
                idx, item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item if isinstance(item, APIError) else engine_unavailable(item)
                if item.finished:
                    self._open[idx] = False
                    if self._owned:
                        self.client.owners.pop(self.jobs[idx].rid, None)
                    self.lease.release_one()
                    self.client.observe(item.result, self.lease.tenant)
                yield idx, item
        finally:
            self.close()

    async def results(self) -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(self.jobs)
        async for idx, delta in self.deltas():
            if delta.finished:
                results[idx] = delta.result
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Abort unfinished jobs and give back the lease (idempotent)."""
        for idx, job in enumerate(self.jobs):
            if self._open[idx]:
                self._open[idx] = False
                self.client.engine.abort(job.rid)
            if self._owned:
                self.client.owners.pop(job.rid, None)
        self._owned = False
        self.lease.close()


class Lease:
    """Admitted engine requests of one HTTP request, of one tenant; each is given back once (close() is
    idempotent)."""

    def __init__(self, client: EngineClient, num: int, tenant: str) -> None:
        self._client = client
        self._num_held = num
        self.tenant = tenant

    def release_one(self) -> None:
        if self._num_held > 0:
            self._num_held -= 1
            self._client._release(1, self.tenant)

    def close(self) -> None:
        if self._num_held > 0:
            self._client._release(self._num_held, self.tenant)
            self._num_held = 0


async def collect(request: Request, sub: Submission) -> list[GenerateResult] | None:
    """Results of all jobs; None if the client disconnected first (the jobs are aborted then)."""
    try:
        disconnected, results = await run_watching_disconnect(request, sub.results())
    finally:
        sub.close()
    if disconnected:
        logger.info("client disconnected; aborted %d request(s)", len(sub.jobs))
        return None
    return results
