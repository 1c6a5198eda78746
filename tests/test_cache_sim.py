"""bench/cache_sim.py, the LRU and Bélády yardsticks of the agent-trace bench, on traces small enough to work out
by hand, and on random ones where the invariants must hold."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.bench.cache_sim import TraceRequest, simulate


def _req(t: float, prompt: list[int], out: list[int] | None = None) -> TraceRequest:
    return TraceRequest(sent_s=t, done_s=t + 0.5, prompt=prompt, output=out or [])


A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def test_belady_keeps_what_comes_back_first_where_lru_keeps_what_came_last():
    """8 slots: A, B, C, then A and B again. C's arrival evicts 4. LRU drops A (oldest), then A's return drops B:
    both miss. Bélády drops B (next used after A): A hits, B misses."""
    trace = [_req(0, A), _req(1, B), _req(2, C), _req(3, A), _req(4, B)]
    assert simulate(trace, 8, "lru") == {"recomputed": 20, "overflow": 0}
    assert simulate(trace, 8, "belady") == {"recomputed": 16, "overflow": 0}


def test_a_continuation_hits_its_history_including_the_output():
    """The output's last token has no KV (no step computed it): the continuation recomputes it."""
    trace = [_req(0, A, out=[40, 41]), _req(1, A + [40, 41, 50])]
    assert simulate(trace, 100, "lru")["recomputed"] == 4 + 2


def test_making_room_never_evicts_the_prefix_the_request_just_matched():
    """At t=2 A's path is next used later than B's, so Bélády would evict A's last token, but the request just
    matched it: room for its new token comes from B, whose last token B recomputes at t=3; A hits at t=5."""
    trace = [_req(0, A), _req(1, B), _req(2, A + [50]), _req(3, B), _req(5, A)]
    assert simulate(trace, 8, "belady") == {"recomputed": 4 + 4 + 1 + 1 + 0, "overflow": 0}


def test_running_requests_are_never_evicted_and_overflow_is_counted():
    trace = [TraceRequest(0, 10, A, [0, 0]), TraceRequest(1, 10, B, [0, 0])]  # both run at once: 12 slots
    assert simulate(trace, 8, "belady") == {"recomputed": 8, "overflow": 4}


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        simulate([], 8, "fifo")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), capacity=st.integers(8, 120))
def test_belady_never_recomputes_more_than_lru_on_sequential_traces(seed, capacity):
    """Requests one at a time (no overlap, so no overflow) over a few shared prefixes: infinite capacity recomputes
    exactly the first-time tokens, and neither policy recomputes less than that."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    trace, seen, cold = [], set(), 0
    for i in range(12):
        prompt = rng.choice(stems) + [rng.randrange(100) for _ in range(rng.randrange(0, 4))]
        trace.append(_req(float(i), prompt))
        for d in range(1, len(prompt) + 1):
            cold += tuple(prompt[:d]) not in seen
            seen.add(tuple(prompt[:d]))
    assert simulate(trace, 10**6, "lru")["recomputed"] == cold == simulate(trace, 10**6, "belady")["recomputed"]
    lru, belady = simulate(trace, capacity, "lru"), simulate(trace, capacity, "belady")
    assert lru["overflow"] == belady["overflow"] == 0
    assert cold <= belady["recomputed"]
    assert cold <= lru["recomputed"]
