"""The policy's memoised state (cached lengths per tree epoch, the prefix-group tree, the last walk)
gives the orders a memo-free policy gives, and the fcfs fallback for very long queues."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.radix.allocator import KVAllocator
from radixserve.radix.radix_cache import RadixCache
from radixserve.scheduler.kv_ops import PrefixKV
from radixserve.scheduler.policy import PolicyConfig, SchedulePolicy
from radixserve.scheduler.req import Req, ReqStatus
from radixserve.scheduler.sampling_params import SamplingParams

_counter = iter(range(10**9))


def make_req(prompt, salt=None, step=0):
    idx = next(_counter)
    return Req(rid=f"m{idx}", prompt_ids=list(prompt), params=SamplingParams(cache_salt=salt), seed=0,
               arrival_step=step, arrival_time=float(idx))


def cache(kv, tokens, salt=None):
    kv.tree.insert(tokens, kv.allocator.alloc(len(tokens)), salt=salt)


def count_matches(kv, monkeypatch):
    calls = []
    real = kv.tree.match_cursor  # every cached length the policy measures goes through it
    monkeypatch.setattr(kv.tree, "match_cursor", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("name", ["lpm", "cache-aware"])
def test_cached_length_memo_is_invalidated_by_insert_and_evict(name, monkeypatch):
    kv = PrefixKV(10_000, 1, False, "lru")
    rng = random.Random(1)
    a, b = ([rng.randrange(10, 4000) for _ in range(64)] for _ in range(2))
    ra, rb = make_req(a), make_req(b)
    pol = SchedulePolicy(name, kv, PolicyConfig(dedup_min_tokens=10**6))
    calls = count_matches(kv, monkeypatch)
    cache(kv, a[:8])
    assert pol.order([ra, rb], 0) == [ra, rb]
    assert pol.cached_len(rb) == 0 and pol.cached_len(ra) == 8
    num = len(calls)
    assert pol.order([ra, rb], 1) == [ra, rb]
    assert len(calls) == num  # nothing changed: no tree walk at all
    cache(kv, b[:40])  # another request's prefix is cached: rb's cached length changes
    assert pol.order([ra, rb], 2) == [rb, ra]
    assert pol.cached_len(rb) == 40
    assert len(calls) > num
    kv.tree.evict(8)  # lru: a's prefix (the older one) goes, b's stays
    assert pol.cached_len(ra) == 0 and pol.cached_len(rb) == 40
    kv.tree.evict(10_000)
    assert pol.cached_len(rb) == 0
    assert pol.order([ra, rb], 3) == [ra, rb]


def test_epoch_moves_only_when_the_cached_set_changes():
    alloc = KVAllocator(1000, 1)
    cache = RadixCache(alloc)
    e0 = cache.epoch
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    e1 = cache.epoch
    assert e1 > e0
    slots, node = cache.match_prefix([1, 2, 9])  # splits an edge: matches unchanged
    cache.lock(node)
    cache.unlock(node)
    cache.peek_prefix([1, 2, 3])
    cache.match_length([1, 2, 3])
    assert cache.insert([1, 2, 3, 4], slots + [7, 8]) == 4  # nothing new
    assert cache.epoch == e1
    cache.insert([5, 6], alloc.alloc(2))
    assert cache.epoch > e1
    e2 = cache.epoch
    cache.evict(1)
    assert cache.epoch > e2
    e3 = cache.epoch
    assert cache.evict(0) == 0 and cache.epoch == e3
    cache.reset()
    assert cache.epoch > e3


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4]),
       st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=24), min_size=1, max_size=8),
       st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=30), st.none() | st.integers(-1, 32),
                          st.sampled_from([None, "s"])), min_size=1, max_size=10))
def test_match_length_equals_peek_prefix(page, inserts, queries):
    alloc = KVAllocator(4096, page)
    cache = RadixCache(alloc, page_size=page)
    for idx, tokens in enumerate(inserts):
        tokens = tokens[:len(tokens) - len(tokens) % page]
        if not tokens:
            continue
        salt = "s" if idx % 3 == 2 else None
        slots = cache.match_prefix(tokens, salt=salt)[0]
        num_cached = cache.insert(tokens, slots + alloc.alloc(len(tokens) - len(slots)), salt=salt)
        assert num_cached == len(slots)
    for tokens, limit, salt in queries:
        want = len(cache.peek_prefix(tokens if limit is None else tokens[:max(limit, 0)], salt=salt))
        assert cache.match_length(tokens, salt, limit=limit) == want


@pytest.mark.parametrize("name", ["lpm", "dfs-weight", "cache-aware"])
def test_memoised_orders_equal_memo_free_orders_under_churn(name):
    """Two policies in lockstep over admissions, arrivals, claims, inserts and evictions; one forgets
    its memos before every call."""
    rng = random.Random(7)
    systems = [[rng.randrange(10, 4000) for _ in range(48)] for _ in range(4)]
    kv = PrefixKV(3000, 1, False, "lru-reuse")
    memo = SchedulePolicy(name, kv, PolicyConfig(window=24, block_size=4))
    fresh = SchedulePolicy(name, kv, PolicyConfig(window=24, block_size=4))

    def new(step):
        return make_req(rng.choice(systems)[:rng.randrange(8, 49)] + [rng.randrange(10, 4000) for _ in range(8)],
                        salt=rng.choice([None, None, "x"]), step=step)

    waiting = [new(0) for _ in range(40)]
    running: list[Req] = []
    for step in range(60):
        fresh._matched.clear()
        fresh._groups = fresh._ordered = None
        out = memo.order(waiting, step, running=running)
        assert [r.rid for r in fresh.order(waiting, step, running=running)] == [r.rid for r in out]
        for req in out[:rng.randrange(0, 4)]:
            waiting.remove(req)
            req.status = ReqStatus.RUNNING
            running.append(req)
        for req in running[:-6]:  # prefill done: no longer a claim
            req.kv_len = len(req.prompt_ids)
        waiting += [new(step) for _ in range(rng.randrange(0, 4))]
        action = rng.random()
        if action < 0.3 and running:
            req = rng.choice(running)
            tokens = req.prompt_ids[:rng.randrange(1, len(req.prompt_ids))]
            slots = kv.tree.match_prefix(tokens, salt=req.params.cache_salt, record_hit=False)[0]
            if kv.allocator.num_free_slots >= len(tokens) - len(slots):
                kv.tree.insert(tokens, slots + kv.allocator.alloc(len(tokens) - len(slots)), salt=req.params.cache_salt)
        elif action < 0.4:
            kv.tree.evict(rng.randrange(1, 60))


def test_fcfs_fallback_above_the_queue_threshold(monkeypatch):
    kv = PrefixKV(10_000, 1, False, "lru-reuse")
    rng = random.Random(3)
    hot = [rng.randrange(10, 4000) for _ in range(32)]
    cache(kv, hot)
    reqs = [make_req([rng.randrange(10, 4000) for _ in range(40)]) for _ in range(4)]
    reqs.append(make_req(hot + [1, 2, 3]))  # the only cached one, last to arrive
    retracted = make_req([5] * 10)
    retracted.num_retractions = 1
    for name in ("lpm", "cache-aware"):
        pol = SchedulePolicy(name, kv, PolicyConfig(fcfs_queue_len=6))
        assert pol.order([retracted] + reqs, 0)[:2] == [retracted, reqs[-1]]  # 6 waiting: not above
        calls = count_matches(kv, monkeypatch)
        longer = reqs + [make_req([7] * 40)]
        assert pol.order([retracted] + longer, 1) == [retracted] + longer  # 7 > 6: arrival order
        assert calls == []  # no tree walk at all
        monkeypatch.undo()
    with pytest.raises(ValueError, match="fcfs_queue_len"):
        PolicyConfig(fcfs_queue_len=0)


def test_a_new_epoch_resumes_each_waiting_match_where_it_stopped(monkeypatch):
    """An insert elsewhere moves the epoch; a waiting request's cached length is then re-measured from the node
    its last match stopped at (no compare of the prefix it already matched), and still agrees with a fresh walk."""
    kv = PrefixKV(10_000, 1, False, "lru")
    rng = random.Random(2)
    system = [rng.randrange(10, 4000) for _ in range(512)]
    waiting = [make_req(system + [rng.randrange(10, 4000) for _ in range(32)]) for _ in range(8)]
    pol = SchedulePolicy("cache-aware", kv, PolicyConfig(dedup_min_tokens=10**6))
    cache(kv, system)
    assert [pol.cached_len(r) for r in waiting] == [512] * 8
    compared = []
    real = kv.tree._common_len
    monkeypatch.setattr(kv.tree, "_common_len", lambda edge, key, pos: compared.append(len(key)) or real(edge, key, pos))
    cache(kv, [rng.randrange(10, 4000) for _ in range(64)])  # another prompt: the epoch moves
    assert [pol.cached_len(r) for r in waiting] == [512] * 8
    assert sum(compared) == 0  # each resumed at the system prompt's node, whose next token has no child
    cache(kv, waiting[0].prompt_ids[:520])  # its own continuation is cached: the resumed walk goes on
    compared.clear()  # (the insert's own walk)
    assert pol.cached_len(waiting[0]) == 520 and sum(compared) == 8
    assert [kv.tree.match_length(r.prompt_ids, limit=kv.match_cap(r)) for r in waiting] == [
        pol.cached_len(r) for r in waiting]
