"""The Engine: public API (ARCHITECTURE §2b) and the step that ties planner, runner and outputs."""
from __future__ import annotations

import logging
import random
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from ..kernels.attention.base import SharedPrefix
from .checks import check_int, check_request, prompt_token_ids
from .config import EngineConfig, fit_context_to_pool
from .constrained import ConstrainedDecoding
from .detokenizer import IncrementalDetokenizer
from .grammar import GrammarBackend
from .kv_ops import PrefixKV
from .kv_swap import session_swap
from .metrics import EngineMetrics, engine_stats, slots_by_tenant
from .output import OutputProcessor
from .planner import Batch, BatchItem, Planner
from .policy import SchedulePolicy
from .reasoning_budget import ReasoningBudget, grammar_active
from .req import ABORTED, GenerateResult, Req, ReqStatus, StreamDelta
from .sampling_params import SamplingParams, choice_rids, choice_seed
from .serving import EngineLoop
from .shared_prefix import order_and_share
from .step_inputs import seq_input
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
ParamsLike = SamplingParams | dict[str, Any] | None


class Engine:
    """Offline and serving entry point, and the driver API its two transports use (the background thread of
    scheduler/serving.py and the engine process of scheduler/engine_process.py): ``add_request``, ``abort``,
    ``step``, ``has_unfinished``, ``abort_all`` and ``step_index``, all called from the one thread that steps.
    While the background loop runs (``start``, ``generate_stream``), ``add_request``, ``abort``, ``generate``,
    ``stats`` and ``flush_cache`` are safe from any thread: the loop queues them for its own."""

    def __init__(self, model_path: str | None = None, **config: Any):
        from ..kernels.runner import ModelRunner  # torch import kept off the radix path

        self.config = EngineConfig.from_kwargs(model_path, **config)
        if model_path is None:
            from ..kernels.demo import demo_model_path
            model_path = demo_model_path()
        self.model_path = model_path
        self.tokenizer = Tokenizer(model_path)
        cfg = self.config
        self.runner = ModelRunner(model_path, num_slots=cfg.kv_cache_tokens, page_size=cfg.page_size,
                                  dtype=cfg.dtype, attention_backend=cfg.attention_backend, device=cfg.device,
                                  context_length=cfg.context_length, max_running_requests=cfg.max_running_requests,
                                  num_threads=cfg.resolved_num_threads(),
                                  retain_host_memory=not cfg.release_host_memory,
                                  native_kernels=not cfg.disable_native_kernels, quantization=cfg.quantization,
                                  kv_cache_dtype=cfg.kv_cache_dtype,
                                  quantized_activations=cfg.quantized_activations)
        num_slots = self.runner.num_slots
        self.model_config = self.runner.config
        self.context_length: int = fit_context_to_pool(self.runner.context_length, num_slots, cfg.page_size,
                                                       context_set=cfg.context_length is not None)
        if self.context_length < self.runner.context_length:
            logger.info("context length capped to %d tokens, what the KV cache holds (the model's is %d): longer "
                        "requests are refused; raise kv_cache_tokens (--kv-cache-tokens) to accept them",
                        self.context_length, self.runner.context_length)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self.kv = PrefixKV(num_slots, cfg.page_size, cfg.disable_radix_cache, cfg.eviction_policy,
                           num_rows=cfg.max_running_requests, reuse_bonus=cfg.reuse_bonus,
                           agent_cache=not cfg.disable_agent_cache, admission_ratio=cfg.session_admission_ratio,
                           swap=session_swap(cfg, self.runner))
        self.policy = SchedulePolicy(cfg.schedule_policy, self.kv, cfg.policy)
        self.planner = Planner(self.config, self.kv, self.policy)
        self.outputs = OutputProcessor(self.eos_token_ids, self.context_length)
        self.grammar = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.metrics = EngineMetrics()
        self.reasoning = ReasoningBudget(self.tokenizer, self.outputs)
        self.constrained = ConstrainedDecoding(self.grammar, self.tokenizer, self.outputs, self.metrics,
                                               self.eos_token_ids, cfg.max_running_requests, self.context_length,
                                               cfg.disable_jump_forward)
        self._rng = random.Random(self.config.seed)
        self._reqs: dict[str, Req] = {}
        self._ready: list[StreamDelta] = []  # deltas made between steps (aborts), returned by the next step
        self.step_index = 0  # steps taken; a request records the one it arrived at
        self._loop = EngineLoop(self)
        logger.info("engine ready: %s, %d KV slots (page size %d), context %d", model_path, num_slots,
                    self.config.page_size, self.context_length)

    # -- submission ---------------------------------------------------------------------

    def add_request(self, prompt: Prompt, sampling_params: ParamsLike = None, rid: str | None = None,
                    on_delta: Callable[[StreamDelta], None] | None = None) -> str:
        """Queue one request; its deltas go to `on_delta` when the background loop dispatches them. Raises
        ValueError on bad input or a request id in use."""
        return self.add_choices(prompt, sampling_params, 1, rid, on_delta)[0]

    def add_choices(self, prompt: Prompt, sampling_params: ParamsLike = None, n: int = 1, rid: str | None = None,
                    on_delta: Callable[[StreamDelta], None] | None = None) -> list[str]:
        """Queue `n` choices of one prompt (the `n` of SGLang and OpenAI): validated once, one token list shared.
        Choice i is `choice_rids(rid, n)[i]` and samples with seed `choice_seed(base, i)` (base: the params' seed,
        or one drawn). Returns the choices' ids. Raises ValueError on bad input or an id in use."""
        check_int("n", n, lo=1)
        params = SamplingParams.from_any(sampling_params, self.tokenizer.default_max_new_tokens)
        prompt_ids = self._prompt_ids(prompt)
        compiled = self._validate(prompt_ids, params)
        rids = choice_rids(rid if rid is not None else uuid.uuid4().hex, n)
        base = params.seed if params.seed is not None else self._rng.getrandbits(63)
        reqs = [self._new_req(choice, prompt_ids, params, choice_seed(base, i), compiled)
                for i, choice in enumerate(rids)]
        self._loop.submit(reqs, on_delta)
        return rids

    def _new_req(self, rid: str, prompt_ids: list[int], params: SamplingParams, seed: int, compiled: Any) -> Req:
        req = Req(rid=rid, prompt_ids=prompt_ids, params=params, seed=seed,
                  arrival_step=self.step_index, arrival_time=time.perf_counter())
        req.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                           spaces_between_special_tokens=params.spaces_between_special_tokens)
        if compiled is not None:
            self.constrained.attach(req, compiled, params)
        self.reasoning.attach(req)
        return req

    def has_request(self, rid: str) -> bool:
        """Whether `rid` is queued or running (a finished request's id may be used again)."""
        return rid in self._reqs

    def admit(self, req: Req) -> None:
        """Queue a built request (the stepping thread; the loop calls it for requests submitted elsewhere)."""
        if req.rid in self._reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        self._reqs[req.rid] = req
        self.planner.enqueue(req)

    def abort(self, rid: str) -> None:
        """Finish a request with finish_reason "abort" and free its KV; its final delta comes with the next step."""
        if self._loop.queue_abort(rid):
            return
        self._ready.extend(self._abort_now(rid))

    def has_unfinished(self) -> bool:
        """Whether step() has anything to do: requests queued or running, or deltas to hand out."""
        return bool(self._ready) or bool(self.planner.waiting) or bool(self.planner.running)

    def abort_all(self, reason: str) -> list[StreamDelta]:
        """End every queued and running request with `reason` (the transports call it as they stop); returns the
        deltas still owed, these final ones included."""
        deltas, self._ready = self._ready, []
        # Requests a failed step already finished still owe their final delta.
        stranded = [r for r in self._reqs.values() if r.status is ReqStatus.FINISHED]
        for req in list(self.planner.running) + list(self.planner.waiting) + stranded:
            self.outputs.finish(req, "abort", error=reason)
            self._finish(req)
            delta = self.outputs.take_delta(req)
            if delta is not None:
                deltas.append(delta)
            self._reqs.pop(req.rid, None)
        return deltas

    # -- offline API --------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: ParamsLike | Sequence[ParamsLike] = None) -> list[GenerateResult]:
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompt_list)
        # Check every prompt before queueing any, so a bad one leaves nothing behind.
        prompt_list = [self._prompt_ids(p) for p in prompt_list]
        params_list = [SamplingParams.from_any(sp, self.tokenizer.default_max_new_tokens) for sp in params_list]
        for ids, params in zip(prompt_list, params_list):
            self._validate(ids, params)
        if self._loop.running:
            return self._loop.generate_blocking(prompt_list, params_list)
        rids = [self.add_request(p, sp) for p, sp in zip(prompt_list, params_list)]
        wanted = set(rids)  # requests added earlier with add_request may finish meanwhile: not this call's
        results: dict[str, GenerateResult] = {}
        while len(results) < len(rids):
            for delta in self.step():
                if delta.finished and delta.result is not None and delta.rid in wanted:
                    results[delta.rid] = delta.result
        return [results[r] for r in rids]

    def generate_stream(self, prompt: Prompt, sampling_params: ParamsLike = None,
                        rid: str | None = None) -> AsyncIterator[StreamDelta]:
        """Deltas from the background loop (``async for``); closing or cancelling the iteration
        before the final delta aborts the request."""
        return self._loop.stream(prompt, sampling_params, rid)

    def start(self) -> None:
        """Run the step loop in a background thread (idempotent)."""
        self._loop.start()

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Run one scheduling decision and (at most) one forward; return the deltas."""
        t0 = time.perf_counter()
        self._parts = dict.fromkeys(self.metrics.step_parts_s, 0.0)
        self._mark = t0
        deltas, self._ready = self._ready, []
        try:
            deltas.extend(self._plan_and_run(t0))
        except Exception:  # the one place a step's failure is caught: its requests end as aborted, the loop goes on
            logger.exception("engine step failed; aborting in-flight requests")
            deltas.extend(self.abort_all("internal error in the engine step"))
        for d in deltas:
            if d.finished:
                self._reqs.pop(d.rid, None)
        self.step_index += 1
        self._record_profile(t0)
        return deltas

    def _plan_and_run(self, t0: float) -> list[StreamDelta]:
        self.kv.sessions.expire()
        batch, admitted = self.planner.schedule(self.step_index)
        for req in admitted:
            req.admit_time = t0
            self.metrics.count_admission(len(req.prompt_ids), req.cached_tokens or 0,
                                         prefix_only=req.prefix_only)
        t1 = self._mark = time.perf_counter()  # outputs are timed from _mark to the end of the step
        self._parts["plan"] += t1 - t0
        if batch.items:
            self._run_batch(batch)
        for item in batch.items:
            self._after_item(item)
        return [d for d in (self.outputs.take_delta(it.req) for it in batch.items) if d is not None]

    def _record_profile(self, t0: float) -> None:
        """Books the step's parts; each is timed on its own, so their sum against the step's
        wall time shows whether anything goes unaccounted (tested within 5%)."""
        m = self.metrics
        end = time.perf_counter()
        parts = self._parts
        parts["outputs"] += end - max(self._mark, t0)
        m.step_time_s += end - t0
        for name, value in parts.items():
            m.step_parts_s[name] += value

    def _run_batch(self, batch: Batch) -> None:
        t0 = time.perf_counter()
        m = self.metrics
        m.num_steps += 1
        m.max_batch_size = max(m.max_batch_size, len(batch.items))
        m.num_mixed_steps += int(batch.is_mixed)
        shared = self._order_and_share(batch)
        seqs = [seq_input(item.req, item.num_tokens, item.sample, self.context_length, self.eos_token_ids)
                for item in batch.items]
        self.constrained.fill_masks(batch.items, seqs)
        num_tokens = sum(len(s.input_ids) for s in seqs)
        m.num_forward_tokens += num_tokens
        t1 = time.perf_counter()
        try:
            outs = self.runner.forward(seqs, shared)
        except Exception as exc:  # a failed forward must not take other requests or the loop down
            logger.exception("forward failed; aborting the %d requests of this batch", len(seqs))
            for item in batch.items:
                self.outputs.finish(item.req, "abort", error=f"forward failed: {exc}")
            return
        prof = self.runner.last_profile
        self._mark = time.perf_counter()
        self._parts["build"] += (t1 - t0) + prof["build_s"]
        self._parts["sample"] += prof["sample_s"]
        # The runner call's wall time less its build and sample parts (its own glue included).
        forward_s = self._mark - t1 - prof["build_s"] - prof["sample_s"]
        self._parts["forward"] += forward_s
        prefill = sum(len(q.input_ids) for q, it in zip(seqs, batch.items) if not it.is_decode)
        if prefill >= 32:  # the prefill cost per token: a session pin's time to live, the shared step budget
            self.kv.sessions.observe_prefill(prefill, forward_s * prefill / num_tokens)
        self.planner.budget.observe(prefill, forward_s)
        for item, seq, out in zip(batch.items, seqs, outs):
            req = item.req
            req.kv_len += item.num_tokens
            self.outputs.record_prompt_logprobs(req, seq.prefix_len, out)
            if item.sample:
                if grammar_active(req):
                    self.constrained.append(req, out.next_token_id, out.next_logprob)
                else:
                    self.outputs.append_token(req, out.next_token_id, out.next_logprob)
                self.reasoning.after_token(req)  # the reasoning's end, and a spent budget's forced end tag
            elif req.num_pending == 0:  # max_new_tokens == 0: the prompt is computed and cached
                self.outputs.finish(req, "length")

    def _after_item(self, item: BatchItem) -> None:
        req = item.req
        if req.finish_reason is not None:
            self._finish(req)
        elif not item.is_decode:
            self.kv.cache_prefix(req)  # a prefilled prefix becomes shareable at once

    def _order_and_share(self, batch: Batch) -> list[SharedPrefix]:
        """Orders the batch so requests below one radix node sit together, and returns the key
        ranges they share (ARCHITECTURE §7)."""
        if self.config.disable_shared_prefix_attention or self.kv.tree.disable or len(batch.items) < 2:
            return []
        order, shared = order_and_share([it.req.last_node for it in batch.items],
                                        self.config.shared_prefix_min_tokens)
        batch.items[:] = [batch.items[i] for i in order]
        if shared:
            m = self.metrics
            m.num_shared_prefix_steps += 1
            m.num_shared_prefix_tokens += sum(p.num_tokens for p in shared)
            m.num_shared_prefix_reads_saved += sum(p.num_tokens * (len(p.seq_idx) - 1) for p in shared)
        return shared

    def _finish(self, req: Req) -> None:
        req.grammar = None  # the matcher is released with the request
        if req.status is ReqStatus.FINISHED:
            return
        self.kv.release(req, finished=req.finish_reason != "abort")
        self.planner.remove(req)
        req.status = ReqStatus.FINISHED
        m = self.metrics
        m.num_requests_finished += 1
        m.num_requests_aborted += int(req.finish_reason == "abort")
        m.num_generated_tokens += len(req.output_ids)

    def _abort_now(self, rid: str) -> list[StreamDelta]:
        req = self._reqs.get(rid)
        if req is None or req.status is ReqStatus.FINISHED:
            return []
        self.outputs.finish(req, "abort", error=ABORTED)
        self._finish(req)
        self._reqs.pop(rid, None)
        delta = self.outputs.take_delta(req)
        return [delta] if delta is not None else []

    # -- cache and stats ----------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Refused (False) while requests are queued or running."""
        return self._on_loop(self._flush_now)

    def _flush_now(self) -> bool:
        if self.has_unfinished():
            return False
        self.kv.flush()
        return True

    def open_session(self, session_id: str | None = None) -> str:
        """Open a session (scheduler/sessions.py): its requests' paths stay pinned between turns. Returns its id."""
        return self._on_loop(lambda: self.kv.sessions.open(session_id))

    def close_session(self, session_id: str) -> bool:
        """Close a session and drop its pin; False when it was not open."""
        return self._on_loop(lambda: self.kv.sessions.close(session_id))

    def settle_session(self, session_id: str, tool: str | None = None) -> bool:
        """The session's turn called `tool` (it is expected back after it) or gave a final answer (None)."""
        return self._on_loop(lambda: self.kv.sessions.settle(session_id, tool))

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        return self._loop.call(fn) if self._loop.running and not self._loop.on_loop_thread() else fn()

    def stats(self) -> dict[str, Any]:
        """A snapshot between steps (safe from any thread: with the loop running it is taken
        on the loop thread; computed on demand, never per step)."""
        return self._on_loop(self._stats_now)

    def set_tenants(self, settings: dict[str, dict[str, Any]]) -> None:
        """Tenants' scheduling settings (the server's keys file, frontend/tenants.py), applied once at start: per
        tenant its fair-share `weight` and `max_running_requests` (None: no cap of its own)."""
        self.planner.set_tenants(settings)

    def tenant_slots(self) -> dict[str, int]:
        """KV slots held by each tenant's running requests (between steps)."""
        return slots_by_tenant(self.planner.running)

    def _stats_now(self) -> dict[str, Any]:
        return engine_stats(self.kv, self.planner, self.metrics)

    def check_integrity(self) -> None:
        """Assert the slot accounting identity (free + evictable + locked + in-flight == total)."""
        self.kv.check_integrity(self.planner.running)

    def shutdown(self) -> None:
        self._loop.stop()
        self.kv.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- validation ---------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> Any | None:
        """The one check of a request against this engine's limits (checks.check_request); returns the compiled
        grammar (or None), compiled here so that a bad grammar is a 400 too."""
        check_request(prompt_ids, params, self.context_length, self.model_config.vocab_size)
        return self.grammar.compile(params) if params.has_grammar else None  # synchronous; cached


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)
