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


def _counts(result: dict) -> dict:
    return {k: result[k] for k in ("recomputed", "overflow", "deferred")}


def test_belady_keeps_what_comes_back_first_where_lru_keeps_what_came_last():
    """8 slots: A, B, C, then A and B again. C's arrival evicts 4. LRU drops A (oldest), then A's return drops B:
    both miss. Bélády drops B (next used after A): A hits, B misses."""
    trace = [_req(0, A), _req(1, B), _req(2, C), _req(3, A), _req(4, B)]
    assert _counts(simulate(trace, 8, "lru")) == {"recomputed": 20, "overflow": 0, "deferred": 0}
    assert _counts(simulate(trace, 8, "belady")) == {"recomputed": 16, "overflow": 0, "deferred": 0}


def test_a_continuation_hits_its_history_including_the_output():
    """The output's last token has no KV (no step computed it): the continuation recomputes it."""
    trace = [_req(0, A, out=[40, 41]), _req(1, A + [40, 41, 50])]
    assert simulate(trace, 100, "lru")["recomputed"] == 4 + 2


def test_making_room_never_evicts_the_prefix_the_request_just_matched():
    """At t=2 A's path is next used later than B's, so Bélády would evict A's last token, but the request just
    matched it: room for its new token comes from B, whose last token B recomputes at t=3; A hits at t=5."""
    trace = [_req(0, A), _req(1, B), _req(2, A + [50]), _req(3, B), _req(5, A)]
    assert _counts(simulate(trace, 8, "belady")) == {"recomputed": 4 + 4 + 1 + 1 + 0, "overflow": 0, "deferred": 0}


def test_a_request_that_does_not_fit_beside_the_running_ones_waits_for_their_finish():
    """8 slots: A (4 + 2 outputs) runs from 0 to 10; B (4 + 2) sent at 1 would need 12 in all. As a server's queue
    would, it waits until A finishes (at 10: A's 5 cached tokens are evictable then), runs for as long as it ran
    (9 s), and so does C, sent at 2 behind it (first come, first served)."""
    trace = [TraceRequest(0, 10, A, [0, 0]), TraceRequest(1, 10, B, [0, 0]), TraceRequest(2, 3, A[:2] + C, [0])]
    result = simulate(trace, 8, "lru")
    assert result["overflow"] == 0 and result["deferred"] == 2 and result["deferred_s"] == (10 - 1) + (19 - 2)
    assert result["recomputed"] == 4 + 4 + 4  # B's room evicts 3 of A's 5 cached tokens; C matches A's first 2


def test_the_server_admission_time_is_when_the_prompt_is_matched_and_locked():
    """B is sent while A runs but admitted after A's finish (the server queued it): from then on they never overlap,
    so nothing waits in the replay, and B matches what A left."""
    trace = [TraceRequest(0, 2, A, [40, 41]), TraceRequest(1, 4, A + [40, 41, 9], [0], admitted_s=2)]
    result = simulate(trace, 8, "lru")
    assert result["deferred"] == 0 and result["recomputed"] == 4 + 2


def test_only_a_request_larger_than_the_cache_runs_over_it():
    result = simulate([TraceRequest(0, 1, A + B, [0, 0]), TraceRequest(0.5, 1, C, [])], 8, "belady")
    assert result["overflow"] == 2 and result["deferred"] == 1 and result["recomputed"] == 12


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
    assert lru["overflow"] == belady["overflow"] == lru["deferred"] == belady["deferred"] == 0
    assert cold <= belady["recomputed"]
    assert cold <= lru["recomputed"]
