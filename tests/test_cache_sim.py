"""bench/cache_sim.py, the LRU, online and Bélády yardsticks of the agent-trace bench, on traces small enough to
work out by hand, and on random ones where the invariants must hold."""
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


def test_online_evicts_a_closed_session_first_where_lru_evicts_the_oldest():
    """8 slots. Session 1 sends A, session 2 sends B and closes; C needs 4 slots. LRU drops A (the oldest) and A's
    continuation recomputes it; the online yardstick knows nobody continues B (and Bélády that nobody uses it),
    although by age alone B would be expected back first (idle 0.5 s where the return gaps, 0.8 s three times, A's
    2.5 and a 9, leave A, idle 1.5 s, 4.25 s more and B 2.3)."""
    trace = [TraceRequest(0, 0.5, A, [], session=1), TraceRequest(1, 1.5, B, [], session=2, closes=True),
             TraceRequest(2, 2.5, C, [], session=3, closes=True), TraceRequest(3, 3.5, A + [50], [], session=1)]
    for i, gap in enumerate([0.8, 0.8, 0.8, 9.0]):  # later sessions on prompts of their own (2 tokens each)
        trace += [TraceRequest(20 + 20 * i, 20 + 20 * i, [100 + i], [], session=10 + i),
                  TraceRequest(20 + 20 * i + gap, 20 + 20 * i + gap, [100 + i, 7], [], session=10 + i)]
    assert simulate(trace, 8, "lru")["recomputed"] == 4 + 4 + 4 + 5 + 8
    assert simulate(trace, 8, "online")["recomputed"] == 4 + 4 + 4 + 1 + 8 == simulate(trace, 8, "belady")["recomputed"]


def test_online_knows_the_next_use_of_a_request_already_sent():
    """A's continuation is sent at 1.8 and queued until 2.5: when C makes room at 2 the online yardstick keeps A
    (used at 2.5, known) and drops B (open, idle 0.5 s: expected back at 2.8 by the one gap seen, A's 1.3 s); LRU
    drops A, the oldest."""
    trace = [TraceRequest(0, 0.5, A, [], session=1), TraceRequest(1, 1.5, B, [], session=2),
             TraceRequest(2, 2.5, C, [], session=3), TraceRequest(1.8, 4, A + [50], [], admitted_s=2.5, session=1)]
    assert simulate(trace, 8, "lru")["recomputed"] == 4 + 4 + 4 + 5
    assert simulate(trace, 8, "online")["recomputed"] == 4 + 4 + 4 + 1


@pytest.mark.parametrize("gaps, a_recomputed", [([0.2, 0.2, 0.2, 9.0], 5), ([2.0] * 4, 1)])
def test_online_orders_waiting_histories_by_their_ages_mean_residual(gaps, a_recomputed):
    """A idle since 0, B since 0.9; at 1.0 C needs one of them gone. Under a heavy tail of return gaps (other
    sessions': 0.2, 0.2, 0.2, 9; A's own 1.5) the one idle longer is expected back last (A: 1 + 4.25 s, B: 0.1 +
    2.1 s), so A goes, as under LRU, and its continuation recomputes all of it. Under gaps of ~2 s the residual
    falls with age and B goes (A: 1 + 0.9 s, B: 0.1 + 1.8 s)."""
    trace = [TraceRequest(0, 0, A, [], session=1), TraceRequest(0.9, 0.9, B, [], session=2),
             TraceRequest(1.0, 1.0, C, [], session=3, closes=True), TraceRequest(1.5, 1.5, A + [50], [], session=1)]
    for i, gap in enumerate(gaps):  # later sessions on prompts of their own: only their return gaps matter
        trace += [TraceRequest(20 + 20 * i, 20 + 20 * i, [100 + i], [], session=10 + i),
                  TraceRequest(20 + 20 * i + gap, 20 + 20 * i + gap, [100 + i, 7], [], session=10 + i)]
    recomputed = simulate(trace, 8, "online")["recomputed"]
    assert recomputed == 4 + 4 + 4 + a_recomputed + sum(1 + 1 for _ in gaps)


@pytest.mark.parametrize("named, a_recomputed", [(False, 5), (True, 1)])
def test_online_expects_a_session_back_after_its_tools_latency_where_the_tool_is_named(named, a_recomputed):
    """The heavy-tailed case above, where the gaps are a fast tool's (0.2 s three times; A's 1.5) and a slow one's
    (9 s); A called the fast tool and B the slow one. Unnamed, A (idle longest) goes. Named, A is expected back
    0.5 s after 1.0 (the fast gaps past its age) and B at 9: B goes, and A's continuation hits."""
    fast, slow = ("fast", "slow") if named else (None, None)
    trace = [TraceRequest(0, 0, A, [], session=1, tool=fast), TraceRequest(0.9, 0.9, B, [], session=2, tool=slow),
             TraceRequest(1.0, 1.0, C, [], session=3, closes=True), TraceRequest(1.5, 1.5, A + [50], [], session=1)]
    for i, (gap, tool) in enumerate([(0.2, fast), (0.2, fast), (0.2, fast), (9.0, slow)]):
        trace += [TraceRequest(20 + 20 * i, 20 + 20 * i, [100 + i], [], session=10 + i, tool=tool),
                  TraceRequest(20 + 20 * i + gap, 20 + 20 * i + gap, [100 + i, 7], [], session=10 + i)]
    assert simulate(trace, 8, "online")["recomputed"] == 4 + 4 + 4 + a_recomputed + 4 * 2


def test_ties_in_the_eviction_rank_break_by_creation_order():
    """A and B are admitted at the same time (their tokens tie under LRU); C needs 4 of the 8 slots: A's path,
    created first, goes whole, B stays (not one token of each, as an order by memory address could pick), and
    every replay counts the same."""
    trace = [_req(0, A), TraceRequest(0, 0.5, B, []), _req(1, C), _req(2, B), _req(3, A)]
    results = {simulate(trace, 8, "lru")["recomputed"] for _ in range(5)}
    assert results == {4 + 4 + 4 + 0 + 4}


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
    for policy in ("lru", "online", "belady"):
        assert simulate(trace, 10**6, policy)["recomputed"] == cold
        result = simulate(trace, capacity, policy)
        assert result["overflow"] == result["deferred"] == 0
        assert cold <= result["recomputed"]
