"""Drive a workload through `radixserve.scheduler.Engine` step by step and measure it (§12).

Deterministic: requests go in through `add_request`, time advances only through `engine.step()`,
decoding is greedy with `ignore_eos` so every request generates exactly its `max_new_tokens`.
A run records, per request, prompt/cached tokens and the time to first token in steps and in
seconds; a run's summary adds the achieved and the optimal hit rate of the prompts actually sent.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..radix.optimal import distinct_tokens, optimal_counts
from .output import percentile
from .workloads import Workload

logger = logging.getLogger(__name__)

# Bench models (§12), seeded random weights: cached_checkpoint's arguments. S, M and "tiny": Llama, fp32, vocab 4096
# ("tiny" is for CI: hit rates and scheduling decisions do not depend on the model's size). L: the Qwen2.5-0.5B
# shape in bf16 with its real vocabulary, where weight streaming and the LM head dominate as in real serving.
_SMALL = dict(arch="llama", vocab_size=4096, max_position_embeddings=4096, dtype="float32")
BENCH_MODELS: dict[str, dict[str, Any]] = {
    "S": dict(_SMALL, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688),
    "M": dict(_SMALL, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048),
    "tiny": dict(_SMALL, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "L": dict(arch="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
              intermediate_size=4864, max_position_embeddings=32768, dtype="bfloat16", tie_word_embeddings=True),
}

MODEL_HELP = ("bench model: S, M, L or tiny (random weights, built once into the cache; tiny runs in seconds), "
              "a checkpoint directory, or a config.json for random weights in its shape")


def bench_model_path(name: str) -> str:
    """Directory of bench model `name`: "demo" (the built-in trained model), one of BENCH_MODELS (built once into the
    radixserve cache), a Hugging Face checkpoint directory (used as it is) or a config.json "shape file" (random
    weights in its shape)."""
    from .checkpoints import cached_checkpoint, checkpoint_for

    if name == "demo":
        from ..kernels.demo import demo_model_path
        return demo_model_path()
    if name in BENCH_MODELS:
        spec = dict(BENCH_MODELS[name])
        return cached_checkpoint(spec.pop("arch"), seed=0, **spec)
    if not os.path.exists(name):
        raise ValueError(f"unknown bench model {name!r}; choose from {', '.join(BENCH_MODELS)}, "
                         "a checkpoint directory or a config.json")
    return checkpoint_for(name)


@dataclass
class RequestRecord:
    key: str
    round_idx: int
    prompt_ids: list[int]
    cache_salt: str | None
    arrival_step: int  # engine steps completed when the request was added
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_token_step: int | None = None  # engine steps completed when its first token came out
    finish_step: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def ttft_steps(self) -> int | None:
        if self.first_token_step is None:
            return None
        return self.first_token_step - self.arrival_step


@dataclass
class RunResult:
    workload: str
    config: dict[str, Any]
    records: list[RequestRecord]
    num_steps: int
    wall_s: float

    def rounds(self) -> list[list[tuple]]:
        """The prompts actually sent and outputs generated, grouped by round (optimal's input)."""
        by_round: dict[int, list[tuple]] = {}
        for rec in self.records:
            by_round.setdefault(rec.round_idx, []).append((rec.prompt_ids, rec.output_ids, rec.cache_salt))
        return [by_round[idx] for idx in sorted(by_round)]

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.records)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.records)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        opt = optimal_counts(self.rounds())
        ttft_steps = [r.ttft_steps for r in self.records if r.ttft_steps is not None]
        ttft_s = [r.ttft_s for r in self.records if r.ttft_s is not None]
        return {
            "workload": self.workload,
            **self.config,
            "num_requests": len(self.records),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "output_tokens": self.output_tokens,
            "hit_rate": self.hit_rate,
            "optimal_computed_tokens": opt.computed_tokens,
            "optimal_hit_rate": opt.hit_rate,
            "hit_rate_vs_optimal": self.hit_rate / opt.hit_rate if opt.hit_rate > 0 else None,
            "num_steps": self.num_steps,
            "wall_s": self.wall_s,
            "req_per_s": len(self.records) / self.wall_s if self.wall_s > 0 else None,
            "tok_per_s": (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else None,
            "ttft_steps_p50": percentile(ttft_steps, 50),
            "ttft_steps_p99": percentile(ttft_steps, 99),
            "ttft_s_p50": percentile(ttft_s, 50),
            "ttft_s_p99": percentile(ttft_s, 99),
        }


def run_workload(engine: Any, workload: Workload, config: dict[str, Any] | None = None,
                 max_steps: int = 1_000_000) -> RunResult:
    """Run every round of `workload` through `engine` (an idle Engine); returns the records.

    Rounds arrive at `workload.arrival_step(r)` or, when that is None, once every earlier request
    has finished. The engine's cache is not flushed here: callers decide (a fresh engine per run).
    """
    from ..scheduler import SamplingParams

    records: dict[str, RequestRecord] = {}
    by_rid: dict[str, RequestRecord] = {}
    outputs: dict[str, list[int]] = {}
    step = 0
    next_round = 0
    start = time.perf_counter()
    while True:
        while next_round < workload.num_rounds and _round_due(workload, next_round, step, engine):
            rnd = workload.make_round(next_round, outputs)
            for req in rnd.requests:
                if req.key in records:
                    raise ValueError(f"workload {workload.name} repeats request key {req.key!r}")
                params = SamplingParams(max_new_tokens=req.max_new_tokens, temperature=0.0,
                                        ignore_eos=True, cache_salt=req.cache_salt)
                rid = engine.add_request(list(req.prompt_ids), params)
                rec = RequestRecord(req.key, next_round, list(req.prompt_ids), req.cache_salt, step)
                records[req.key] = by_rid[rid] = rec
            next_round += 1
        if not engine.has_unfinished():
            if next_round >= workload.num_rounds:
                break
            # Idle until a fixed arrival: skip the empty steps.
            step = max(step, workload.arrival_step(next_round) or step)
            continue
        if step >= max_steps:
            raise RuntimeError(f"workload {workload.name} did not finish in {max_steps} steps")
        deltas = engine.step()
        step += 1
        for delta in deltas:
            _record_delta(by_rid[delta.rid], delta, step, outputs)
    wall_s = time.perf_counter() - start
    return RunResult(workload.name, dict(config or {}), list(records.values()), step, wall_s)


def stand_in_rounds(make: Callable[[], Workload], seed: int = 12345) -> list[list[tuple]]:
    """The workload's rounds with stand-in outputs (random ids of the right lengths), no engine."""
    import random

    rng = random.Random(seed)
    workload = make()
    outputs: dict[str, list[int]] = {}
    rounds = []
    for idx in range(workload.num_rounds):
        items = []
        for req in workload.make_round(idx, outputs).requests:
            out = [rng.randrange(10, 4000) for _ in range(req.max_new_tokens)]
            outputs[req.key] = out
            items.append((req.prompt_ids, out, req.cache_salt))
        rounds.append(items)
    return rounds


def estimate_distinct_tokens(make: Callable[[], Workload], seed: int = 12345) -> int:
    """Distinct tokens of a workload run with stand-in outputs.

    Equal to the real count unless two requests have identical prompts (then their greedy
    outputs coincide and this over-counts): an upper bound, good for sizing a pool that never
    evicts.
    """
    return distinct_tokens(stand_in_rounds(make, seed))


def budget_tokens(make: Callable[[], Workload], fraction: float, max_running_requests: int,
                  page_size: int = 1) -> int:
    """kv_cache_tokens for a §12 budget: `fraction` of the workload's distinct tokens plus the
    decode room of the requests that may run at once."""
    rounds = stand_in_rounds(make)
    return kv_budget(distinct_tokens(rounds), fraction, decode_room(rounds, max_running_requests), page_size)


def decode_room(rounds: list[list[tuple]], max_running_requests: int) -> int:
    """KV the running requests need for their outputs: the largest outputs of any one round,
    as many as may run at once."""
    room = 0
    for items in rounds:
        lens = sorted((len(item[1]) for item in items), reverse=True)
        room = max(room, sum(lens[:max_running_requests]))
    return room


def kv_budget(num_distinct: int, fraction: float, room: int, page_size: int = 1) -> int:
    """§12: a fraction of the workload's distinct tokens plus the running requests' decode room."""
    if not 0 < fraction:
        raise ValueError(f"budget fraction must be positive, got {fraction}")
    tokens = int(round(fraction * num_distinct)) + room
    return -(-tokens // page_size) * page_size


def median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary out of repeated runs: the median of every timing field, the rest from run 0."""
    timed = ("wall_s", "req_per_s", "tok_per_s", "ttft_s_p50", "ttft_s_p99")
    out = dict(summaries[0])
    for key in timed:
        values = [s[key] for s in summaries if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["num_runs"] = len(summaries)
    out["wall_s_runs"] = [s["wall_s"] for s in summaries]
    return out


def _round_due(workload: Workload, round_idx: int, step: int, engine: Any) -> bool:
    fixed = workload.arrival_step(round_idx)
    if fixed is None:
        return not engine.has_unfinished()
    return step >= fixed


def _record_delta(rec: RequestRecord, delta: Any, step: int, outputs: dict[str, list[int]]) -> None:
    if delta.token_ids and rec.first_token_step is None:
        rec.first_token_step = step
    rec.output_ids.extend(delta.token_ids)
    if delta.finished:
        rec.finish_step = step
        result = delta.result
        if result is not None:
            rec.cached_tokens = result.cached_tokens
            rec.ttft_s = result.ttft_s
            rec.e2e_s = result.e2e_s
            if list(result.output_ids) != rec.output_ids:
                logger.warning("request %s: streamed ids differ from the result's", rec.key)
                rec.output_ids = list(result.output_ids)
            if result.finish_reason == "abort":
                raise RuntimeError(f"request {rec.key} was aborted: {result.error}")
        outputs[rec.key] = list(rec.output_ids)


def repeated_runs(engine: Any, make: Callable[[], Workload], config: dict[str, Any], num_runs: int = 3,
                  on_run: Callable[[], object] = lambda: None) -> tuple[dict[str, Any], list[RunResult]]:
    """Warm up, then `num_runs` runs of a fresh workload on an emptied cache; the median summary.
    on_run() is called after each run (a progress bar's update).

    Every run sends the same tokens (greedy, same engine), so counts agree across runs; only the
    timings vary and are reported as medians.
    """
    warm_up(engine)
    results = []
    for _ in range(num_runs):
        if not engine.flush_cache():
            raise RuntimeError("flush_cache refused: the engine still has running requests")
        results.append(run_workload(engine, make(), config))
        on_run()
    summaries = [r.summary() for r in results]
    cached = {s["cached_tokens"] for s in summaries}
    if len(cached) > 1:
        logger.warning("%s: cached tokens differ across runs: %s", results[0].workload, sorted(cached))
    return median_summary(summaries), results


def warm_up(engine: Any) -> None:
    """One short request so that first-call costs (allocation, kernel set-up) stay out of timings."""
    from ..scheduler import SamplingParams

    engine.generate([list(range(100, 164))], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    engine.flush_cache()
