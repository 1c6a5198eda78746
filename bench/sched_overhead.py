"""Scheduling cost: policy ordering time with many waiting requests, and radix + scheduling time per
engine step against the forward (issue 4: target < 2% of step time on bench model M at batch 32)."""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

from .workloads import TOKEN_HI, TOKEN_LO


def ordering_cost(policies: list[str], queue_sizes: list[int], num_groups: int = 8, system_len: int = 1024,
                  question_len: int = 64, repeats: int = 5, seed: int = 0) -> list[dict[str, Any]]:
    """Time of one SchedulePolicy.order() call with N gsp-shaped requests waiting (half the groups'
    system prompts cached). `first_call_ms` includes hashing each prompt once; `steady_ms` is the
    median of the following calls (the queue as the planner sees it step after step)."""
    from ..scheduler.kv_ops import PrefixKV
    from ..scheduler.policy import SchedulePolicy
    from ..scheduler.req import Req
    from ..scheduler.sampling_params import SamplingParams

    rng = random.Random(seed)
    systems = [[rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(system_len)] for _ in range(num_groups)]
    rows = []
    for num_waiting in queue_sizes:
        reqs = []
        for idx in range(num_waiting):
            prompt = systems[rng.randrange(num_groups)] + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(question_len)]
            reqs.append(Req(rid=f"w{idx}", prompt_ids=prompt, params=SamplingParams(), seed=0,
                            arrival_step=0, arrival_time=float(idx)))
        for name in policies:
            kv = PrefixKV(num_groups * system_len + 16, 1, False, "lru-reuse")
            for system in systems[:num_groups // 2]:
                kv.tree.insert(system, kv.allocator.alloc(system_len))
            policy = SchedulePolicy(name, kv)
            times = []
            for step in range(repeats + 1):
                start = time.perf_counter()
                policy.order(reqs, step)
                times.append(time.perf_counter() - start)
            rows.append({"policy": name, "num_waiting": num_waiting, "first_call_ms": 1e3 * times[0],
                         "steady_ms": 1e3 * statistics.median(times[1:])})
    return rows


def step_overhead(model_path: str, batch: int = 32, num_groups: int = 4, system_len: int = 256,
                  question_len: int = 32, output_len: int = 32, seed: int = 0) -> dict[str, Any]:
    """Run `batch` requests at once (gsp-shaped) and split step time by the engine's step profile
    (stats()["step_parts_s"]): host work = plan + build + sample + outputs, i.e. everything but
    the model's forward (inputs, detokenization and stop checks included)."""
    import torch

    from ..scheduler import Engine, SamplingParams

    rng = random.Random(seed)
    systems = [[rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(system_len)] for _ in range(num_groups)]
    prompts = [systems[i % num_groups] + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(question_len)]
               for i in range(batch)]
    engine = Engine(model_path, max_running_requests=batch, num_threads=torch.get_num_threads(),
                    kv_cache_tokens=batch * (system_len + question_len + output_len) + 1024)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:64]], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    engine.flush_cache()
    for prompt in prompts:
        engine.add_request(prompt, params)
    per_step = []  # (host s, forward s, running)
    while engine.has_unfinished():
        before = engine.stats()["step_parts_s"]
        engine.step()
        stats = engine.stats()
        parts = {k: v - before[k] for k, v in stats["step_parts_s"].items()}
        per_step.append((sum(parts.values()) - parts["forward"], parts["forward"], stats["num_running"]))
    engine.shutdown()
    full = [(h, f) for h, f, n in per_step if n == batch]  # steps with the whole batch decoding
    host_total = sum(h for h, _, _ in per_step)
    fwd_total = sum(f for _, f, _ in per_step)
    return {
        "batch": batch, "num_steps": len(per_step), "num_full_batch_steps": len(full),
        "host_ms_per_step": 1e3 * host_total / len(per_step),
        "forward_ms_per_step": 1e3 * fwd_total / len(per_step),
        "host_share": host_total / (host_total + fwd_total),
        "full_batch_host_ms_median": 1e3 * statistics.median(h for h, _ in full) if full else None,
        "full_batch_forward_ms_median": 1e3 * statistics.median(f for _, f in full) if full else None,
        "full_batch_host_share": (sum(h for h, _ in full) / sum(h + f for h, f in full)) if full else None,
    }
