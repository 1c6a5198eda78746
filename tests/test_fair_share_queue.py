"""The fair share's view of the waiting queue (scheduler/tenant_queues.py, FairShare.join / leave): the order it reads
without a pass over the queue is the one a pass gives, the view follows the planner's queue through admissions,
retractions and aborts, the planner's work per step does not grow with the queue, and a light tenant's request
behind a full batch and a long backlog of a heavy one is admitted at once (issue 41)."""
from __future__ import annotations

import random

import pytest
import torch

from radixserve.scheduler import Engine, SamplingParams
from radixserve.scheduler.fair_share import FairShare
from radixserve.scheduler.req import Req

from _engine_helpers import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint(tmp_path_factory, "fair-queue")


def _req(tenant: str, n: int, prompt_len: int = 8, retracted: bool = False) -> Req:
    req = Req(rid=f"{tenant}{n}", prompt_ids=[1 + n % 7] * prompt_len, seed=0, arrival_step=n, arrival_time=0.0,
              params=SamplingParams(max_new_tokens=4, tenant=tenant))
    req.num_retractions = int(retracted)
    return req


@pytest.mark.parametrize("seed", range(20))
def test_the_order_read_from_the_tracked_queues_is_the_order_of_a_pass(seed):
    """A queue as the planner keeps it (retracted requests first, then fresh ones in arrival order), the policy's
    own order of its first entries (a window, some deferred), random counters: the merge over the tracked queues
    (reading only the lead and what it takes) gives the same order as grouping the whole queue."""
    rng = random.Random(seed)
    tenants = ["a", "b", "c"][:rng.randint(2, 3)]
    fresh = [_req(rng.choice(tenants), i, prompt_len=rng.randint(4, 40)) for i in range(rng.randint(2, 60))]
    retracted = [_req(rng.choice(tenants), 100 + i, retracted=True) for i in range(rng.randint(0, 3))]
    window = fresh[:rng.randint(0, len(fresh))]
    placed = rng.sample(window, rng.randint(0, len(window)))  # the policy's order of its window; the rest deferred
    base = retracted + placed + fresh[len(window):]
    cached = {id(r): rng.randint(0, len(r.prompt_ids)) for r in base}
    orders = []
    for tracked in (True, False):
        share = FairShare({"c": 2.0})
        share.tracked = tracked
        for req in fresh + retracted:  # the order they joined: arrivals, then the retractions
            share.join(req)
        for tenant in tenants:
            share.counters[tenant] = random.Random(f"{seed}{tenant}").uniform(0, 60)
        orders.append(share.order(base, lambda r: cached[id(r)], lead=len(retracted) + len(placed), window=window))
    assert [r.rid for r in orders[0]] == [r.rid for r in orders[1]]
    assert sorted(r.rid for r in orders[0]) == sorted(r.rid for r in base)


def test_the_tracked_queues_follow_the_planner_through_admission_retraction_and_abort(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=512, max_running_requests=3, chunked_prefill_size=32)
    share = engine.planner.policy.share
    rng = random.Random(0)
    live: list[str] = []
    for i in range(150):
        op = rng.random()
        if op < 0.4:
            tenant = rng.choice(["heavy", "heavy", "light"])
            rid = engine.add_request([rng.randrange(5, 400) for _ in range(rng.randint(4, 60))],
                                     SamplingParams(max_new_tokens=rng.randint(1, 30), tenant=tenant,
                                                    ignore_eos=True), rid=f"r{i}")
            live.append(rid)
        elif op < 0.5 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        else:
            engine.step()
        waiting = engine.planner.waiting
        assert len(share.queues) == len(waiting) and all(r in share.queues for r in waiting)
        assert sorted(share.queues.tenants()) == sorted({r.params.tenant for r in waiting})
    assert engine.planner.num_retractions > 0  # the small pool made it retract (and re-queue) some
    engine.check_integrity()
    engine.shutdown()


class _CountedReq(Req):
    """Counts the reads of its `params`: the planner's per-request work, in counts rather than time."""

    reads = 0

    @property
    def params(self) -> SamplingParams:
        _CountedReq.reads += 1
        return self._params

    @params.setter
    def params(self, value: SamplingParams) -> None:
        self._params = value


def _reads_per_step(ckpt: str, backlog: int) -> int:
    """A full batch of the heavy tenant's requests, `backlog` more of them waiting and one of the light tenant's:
    the reads of the requests' params in one step, once every waiting request has been seen."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=2048, max_running_requests=4, chunked_prefill_size=64,
                    policy={"window": 16})
    system = list(range(10, 42))
    params = SamplingParams(max_new_tokens=30, tenant="heavy", ignore_eos=True)
    for i in range(backlog + 4):
        engine.add_request(system + [100 + i % 300, 50], params, rid=f"h{i}")
    for _ in range(3):
        engine.step()
    engine.add_request(system + [7, 8], SamplingParams(max_new_tokens=30, tenant="light"), rid="light")
    engine.step()  # the light request is admitted (a heavy one preempted for it)
    engine.add_request(system + [9, 9], SamplingParams(max_new_tokens=30, tenant="light"), rid="light2")
    for req in engine.planner.waiting + engine.planner.running:
        req._params, req.__class__ = req.params, _CountedReq
    _CountedReq.reads = 0
    engine.step()  # and so is the second: the merge of the two tenants' queues runs
    reads = _CountedReq.reads
    assert engine.planner.waiting[0].__class__ is _CountedReq and len(engine.planner.waiting) >= backlog
    assert "light2" in {r.rid for r in engine.planner.running}
    engine.shutdown()
    return reads


def test_the_planners_reads_per_step_do_not_grow_with_the_backlog(ckpt):
    """What a step reads is the policy's window (16), the batch (4 running, a light one admitted, a heavy one
    preempted) and the step's outputs: a backlog 16x as long adds nothing (one pass over it would add 1,024 reads;
    the fair share's passes over the queue came to 3 before the queues were tracked)."""
    small, large = _reads_per_step(ckpt, 64), _reads_per_step(ckpt, 1024)
    assert large <= small + 16 and large < 600, (small, large)


def test_a_light_request_behind_a_full_batch_and_a_long_heavy_backlog_is_admitted_in_the_next_step(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=4096, max_running_requests=4, chunked_prefill_size=64)
    system = list(range(10, 42))
    for i in range(300):
        engine.add_request(system + [100 + i % 300, 50], SamplingParams(max_new_tokens=40, tenant="heavy",
                                                                         ignore_eos=True), rid=f"h{i}")
    waits = []
    for k in range(6):
        for _ in range(5):
            engine.step()
        assert len(engine.planner.running) == 4 and len(engine.planner.waiting) > 250
        engine.add_request(system + [200 + k, 60], SamplingParams(max_new_tokens=4, tenant="light",
                                                                  ignore_eos=True), rid=f"light{k}")
        steps = 1
        while not any(d.rid == f"light{k}" and d.token_ids for d in engine.step()):
            steps += 1
        waits.append(steps)
    assert max(waits) == 1, waits  # its prefill runs in the very next step, however long the heavy queue
    engine.shutdown()
