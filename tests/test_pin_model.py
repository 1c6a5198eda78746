"""The pins' cost model (scheduler/sessions.py, scheduler/return_gaps.py) on a bare radix tree with a clock the test
moves: when a session is expected back, which pin admission reclaims first, and when a pin is not worth making."""
from __future__ import annotations

import pytest

from radixserve.radix import KVAllocator, RadixCache
from radixserve.scheduler.return_gaps import MAX_TOOLS, MIN_OWN, ReturnGaps, ToolGaps
from radixserve.scheduler.sessions import PIN_ODDS, PRESSURE_WINDOW_S, Sessions

HEAVY = [0.5] * 8 + [20.0] * 2  # most agents back within a second, a few after a long tool
LONG, SHORT = [30.0] * 10, [0.1] * 10


def test_without_returns_observed_the_default_gap_then_the_age():
    gaps = ReturnGaps(default_s=1.0)
    assert gaps.remaining(0.0) == 1.0 and gaps.remaining(0.25) == 0.75 and gaps.remaining(3.0) == 3.0
    assert gaps.within(0.5) == 0.0 and gaps.within(1.0) == 1.0


def test_a_heavy_tailed_return_is_expected_later_the_longer_the_session_has_been_away():
    gaps = _gaps(HEAVY)
    assert gaps.remaining(0.0) == pytest.approx((8 * 0.5 + 2 * 20.0) / 10)  # 4.4: the mean
    assert gaps.remaining(1.0) == pytest.approx(19.0)  # past every short one: only the long ones are left
    assert gaps.remaining(25.0) == 25.0  # past every gap observed: as long again
    assert gaps.within(1.0) == 0.8


def test_a_fixed_latency_is_expected_sooner_the_longer_the_session_has_been_away():
    gaps = _gaps([5.0] * 4)
    assert gaps.remaining(0.0) == 5.0 and gaps.remaining(4.0) == 1.0


def test_the_window_keeps_the_latest_returns():
    gaps = ReturnGaps(window=3)
    for gap in (100.0, 1.0, 1.0, 1.0):
        gaps.add(gap)
    assert len(gaps) == 3 and gaps.remaining(0.0) == 1.0


@pytest.mark.parametrize("returns, dropped", [(HEAVY, "old"), ([5.0] * 4, "new")])
def test_admission_reclaims_the_pin_whose_session_is_expected_back_last(returns, dropped):
    """Two pins of equal length (their recompute cost per slot ties), made at 0 and 4 s. Heavy-tailed returns: the
    one away for 4 s is past the short gaps, expected back last (at 20 s, the new one at 8.4 s). A fixed 5 s latency:
    the old one is due at 5 s, the new one at 9 s. Admission needs one pin's slots: that pin goes."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["old", "new"], 10)
    for gap in returns:
        sessions.gaps.add(gap)
    sessions.keep("old", nodes["old"], 10)
    clock[0] = 4.0
    sessions.keep("new", nodes["new"], 10)
    sessions.reclaim(10)
    assert set(sessions._pins) == {"old", "new"} - {dropped} and sessions.counts["reclaimed"] == 1


@pytest.mark.parametrize("returns, queue_excess, pinned", [
    (SHORT, 0, True),  # back well within the horizon (40 later-expected slots at 4 slots/s: 10 s)
    (HEAVY, 0, True),  # 80% back within it
    (LONG, 0, False),  # none back within it: the pin would only displace cache
    (HEAVY, 40, False),  # the waiting queue needs the later pins' slots: this one would go next, at once
])
def test_under_pressure_a_pin_is_made_only_if_its_session_is_expected_back_before_it_is_reclaimed(
        returns, queue_excess, pinned):
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["gone", "far", "new"], 40)
    sessions.keep("gone", nodes["gone"], 40)
    sessions.keep("far", nodes["far"], 40)
    for gap in returns:
        sessions.gaps.add(gap)
    clock[0] = 40.0  # "far" has been away for 40 s: expected back after the new one, whatever the returns
    sessions.reclaim(40)  # admission reclaims one pin (40 slots; the two tie): 4 slots/s over the window
    assert set(sessions._pins) == {"far"}
    clock[0] += 1.0
    sessions.keep("new", nodes["new"], 40, queue_excess=queue_excess)
    assert ("new" in sessions._pins) == pinned and sessions.counts["skipped"] == int(not pinned)


def test_closing_a_session_evicts_its_last_path_first_even_unpinned():
    """Under pressure the last turn's pin was skipped; the session then closes: nobody will continue its path, so
    it goes before an older one (Bélády's never-again first), as a closed pin's does."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["gone", "far", "new"], 40)
    sessions.keep("gone", nodes["gone"], 40)
    sessions.keep("far", nodes["far"], 40)
    for gap in LONG:
        sessions.gaps.add(gap)
    clock[0] = 40.0
    sessions.reclaim(40)  # "gone" is unpinned: cached, older than "new"
    clock[0] += 1.0
    sessions.keep("new", nodes["new"], 40)
    assert "new" not in sessions._pins and sessions.close("new")
    tree = sessions._tree
    assert tree.evict(40) == 40
    assert tree.peek_prefix([3000 + j for j in range(40)]) == []
    assert len(tree.peek_prefix([1000 + j for j in range(40)])) == 40


def test_without_pressure_every_finished_turn_is_pinned():
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["a"], 10)
    for gap in LONG:
        sessions.gaps.add(gap)
    sessions.keep("a", nodes["a"], 10, queue_excess=-100)
    assert "a" in sessions._pins and not sessions.under_pressure()
    clock[0] = 1.0
    sessions.note_eviction()  # an admission evicted cached paths: pressure, for the window
    assert sessions.under_pressure()
    clock[0] += PRESSURE_WINDOW_S + 0.1
    assert not sessions.under_pressure()


def test_the_return_gap_is_observed_from_the_finish_to_the_next_arrival():
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["a"], 10)
    sessions.keep("a", nodes["a"], 10)
    clock[0] = 2.5
    sessions.arrived("a")
    sessions.arrived("a")  # a retraction's second stay in the queue is no return
    sessions.arrived(None)
    assert len(sessions.gaps.all) == 1 and sessions.gaps.all.remaining(0.0) == 2.5
    assert 0 < PIN_ODDS < 1


def test_a_tool_answers_for_itself_once_it_has_enough_returns():
    gaps = ToolGaps()
    for _ in range(MIN_OWN - 1):
        gaps.add(0.2, "calc")
        gaps.add(30.0, "human")
    assert gaps.of("calc") is gaps.of("human") is gaps.of(None) is gaps.all  # too few of their own yet
    gaps.add(0.2, "calc")
    gaps.add(9.0)  # a token-level turn's return: everyone's only
    assert gaps.of("calc").remaining(0.0) == pytest.approx(0.2) and gaps.of("human") is gaps.all
    assert len(gaps.all) == 2 * MIN_OWN and gaps.named == 2 * MIN_OWN - 1
    for k in range(MAX_TOOLS):  # names come from model output: only the most recently called tools are kept
        gaps.add(1.0, f"tool{k}")
    assert gaps.of("calc") is gaps.all and len(gaps._by_tool) == MAX_TOOLS


@pytest.mark.parametrize("named, dropped", [(True, "b"), (False, "a")])
def test_admission_reclaims_the_pin_whose_tool_returns_last(named, dropped):
    """Calculator calls return in 0.5 s, a human's answer in 30 s. Pin a (made at 0) waits on the calculator, b
    (made at 0.9) on the human. At 1.0 admission needs one pin's slots. By age alone (no tool named: a token-level
    turn) a is past every short return, so expected last (at 30 s; b at ~16 s), and goes. With the tools named,
    b's own gaps say 30 s and a's say it is overdue (as long again: 2 s): b goes."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["a", "b", "x"], 10)
    _calculator_and_human(sessions, nodes["x"], clock)
    assert sessions.stats()["num_tool_returns"] == 2 * MIN_OWN
    start = clock[0]
    for sid, tool, made in (("a", "calc", 0.0), ("b", "human", 0.9)):
        clock[0] = start + made
        sessions.keep(sid, nodes[sid], 10)
        if named:
            assert sessions.settle(sid, tool)
    clock[0] = start + 1.0
    sessions.reclaim(10)
    assert set(sessions._pins) == {"a", "b"} - {dropped}


@pytest.mark.parametrize("named, evicted", [(True, "b"), (False, "a")])
def test_admission_evicts_the_unpinned_history_whose_session_is_expected_back_last(named, evicted):
    """The tools and times of the test above, but admission reclaimed both pins: the histories are cached, unpinned,
    and admission must evict one. LRU would take a (cached first). With the tools named, b waits on a human (due in
    ~30 s) while a's calculator call is overdue: b goes (`rank_away`). Unnamed, a is past every short return and
    expected last: a goes, as LRU would."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["a", "b", "x"], 10)
    _calculator_and_human(sessions, nodes["x"], clock)
    start = clock[0]
    for sid, tool, made in (("a", "calc", 0.0), ("b", "human", 0.9)):
        clock[0] = start + made
        sessions.keep(sid, nodes[sid], 10)
        if named:
            sessions.settle(sid, tool)
    clock[0] = start + 1.0
    sessions.reclaim(20)
    assert not sessions._pins
    tree = sessions._tree
    sessions.rank_away(10)
    assert tree.evict(10) == 10
    assert _cached(tree, ["a", "b", "x"], 10) == {"a", "b", "x"} - {evicted}
    tree.check_integrity()


@pytest.mark.parametrize("named, evicted", [(True, "b"), (False, "a")])
def test_admission_takes_a_pinned_history_expected_back_after_the_unpinned_one(named, evicted):
    """The tools and times above, but b (the human, made at 0.9) is pinned and a (the calculator, made at 0) is not:
    its pin was skipped, the queue then needing more than the pool had. Admission evicts one history: LRU's is a's,
    the oldest unpinned. Named, a is overdue and b not due for ~29 s: b's pin is reclaimed and b goes instead.
    Unnamed, a is expected last by age and goes, as LRU would."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["a", "b", "x"], 10)
    _calculator_and_human(sessions, nodes["x"], clock)
    start = clock[0]
    for sid, tool, made, excess in (("a", "calc", 0.0, 20), ("b", "human", 0.9, 0)):
        clock[0] = start + made
        sessions.keep(sid, nodes[sid], 10, queue_excess=excess)
        if named:
            sessions.settle(sid, tool)
    assert set(sessions._pins) == {"b"}
    clock[0] = start + 1.0
    tree = sessions._tree
    sessions.rank_away(10)
    assert tree.evict(10) == 10
    assert _cached(tree, ["a", "b", "x"], 10) == {"a", "b", "x"} - {evicted}
    assert sessions.counts["reclaimed"] == (evicted == "b")
    tree.check_integrity()


@pytest.mark.parametrize("calc, human, tool, pinned_at_keep, pinned_after", [
    (8, 9, "calc", False, True),  # everyone's returns: 8 of 17 within the horizon, skipped; the calculator's: all
    (8, 9, "human", False, False),
    (9, 8, "human", True, False),  # 9 of 17: pinned; a human's answer never comes within it: the pin goes
    (9, 8, "calc", True, True),
])
def test_a_named_tool_decides_the_pin_again_from_its_own_returns(calc, human, tool, pinned_at_keep, pinned_after):
    """Under pressure (the 10 s horizon of the test above), keep decides from everyone's returns, the calculator's
    0.5 s and a human's 30 s; the turn's tool call, named once the reply is parsed, decides again from its own."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["gone", "far", "new"], 40)
    sessions.keep("gone", nodes["gone"], 40)
    sessions.keep("far", nodes["far"], 40)
    for name, count, gap in (("calc", calc, 0.5), ("human", human, 30.0)):
        for _ in range(count):
            sessions.gaps.add(gap, name)
    clock[0] = 40.0
    sessions.reclaim(40)
    clock[0] += 1.0
    sessions.keep("new", nodes["new"], 40)
    assert ("new" in sessions._pins) == pinned_at_keep
    assert sessions.settle("new", tool)
    assert ("new" in sessions._pins) == pinned_after
    counts = sessions.counts
    assert counts["pinned"] + counts["skipped"] == 3 and counts["skipped"] == 1 - pinned_after
    assert sessions._tree.pinned_size == 40 * (1 + pinned_after)


def test_a_named_tools_horizon_counts_the_pins_expected_back_after_it():
    """Returns: the calculator's 0.5 s, a search's 11 s, a human's 30 s (everyone's mean 13.8 s). At 41 s pin
    `far` (everyone's: overdue, at 82 s) and `mid` (waiting on a human for 17.5 s: at 53.5 s) are left, 40 slots
    each, reclaimed at 4 slots/s. A new turn expected back at everyone's mean (54.8 s) would outlast only `far`:
    a 10 s horizon, within which no search returns, so keep skips it. Named, it calls the search, back at 52 s,
    before `mid` too: 20 s, within which every search returns, and it is pinned."""
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["gone", "far", "mid", "new"], 40)
    for name, gap in (("calc", 0.5), ("search", 11.0), ("human", 30.0)):
        for _ in range(MIN_OWN):
            sessions.gaps.add(gap, name)
    sessions.keep("gone", nodes["gone"], 40)
    sessions.keep("far", nodes["far"], 40)
    clock[0] = 23.5
    sessions.keep("mid", nodes["mid"], 40)
    assert sessions.settle("mid", "human") and "mid" in sessions._pins
    clock[0] = 40.0
    sessions.reclaim(40)
    assert set(sessions._pins) == {"far", "mid"}
    clock[0] = 41.0
    sessions.keep("new", nodes["new"], 40)
    assert "new" not in sessions._pins
    sessions.settle("new", "search")
    assert "new" in sessions._pins


def test_a_new_turn_forgets_the_last_turns_tool():
    clock = [0.0]
    sessions, nodes = _sessions(clock, ["a"], 10)
    sessions.keep("a", nodes["a"], 10)
    assert sessions.settle("a", "calc") and not sessions.settle("nobody", "calc")
    clock[0] = 1.0
    sessions.arrived("a")
    sessions.take("a")
    sessions.keep("a", nodes["a"], 10)  # finished again; no call named (yet): its return counts for everyone only
    clock[0] = 3.0
    sessions.arrived("a")
    assert len(sessions.gaps.all) == 2 and sessions.gaps.named == 1


def _gaps(values: list[float]) -> ReturnGaps:
    gaps = ReturnGaps()
    for gap in values:
        gaps.add(gap)
    return gaps


def _sessions(clock: list[float], names: list[str], length: int) -> tuple[Sessions, dict]:
    """Open sessions, each with a cached path of `length` tokens of its own (no shared prefix)."""
    allocator = KVAllocator(256, 1)
    tree = RadixCache(allocator, page_size=1)
    sessions = Sessions(tree, clock=lambda: clock[0])
    nodes = {}
    for i, name in enumerate(names):
        sessions.open(name)
        tokens = [1000 * (i + 1) + j for j in range(length)]
        tree.insert(tokens, allocator.alloc(length))
        nodes[name] = tree.match_prefix(tokens)[1]
    return sessions, nodes


def _cached(tree: RadixCache, names: list[str], length: int) -> set[str]:
    """The sessions of `_sessions` whose whole path is still cached."""
    return {name for i, name in enumerate(names)
            if len(tree.peek_prefix([1000 * (i + 1) + j for j in range(length)])) == length}


def _calculator_and_human(sessions: Sessions, node, clock: list[float]) -> None:
    """MIN_OWN earlier turns of session x each calling the calculator (back in 0.5 s) and a human (back in 30 s);
    then x closes."""
    for _ in range(MIN_OWN):
        for tool, gap in (("calc", 0.5), ("human", 30.0)):
            sessions.keep("x", node, 10)
            sessions.settle("x", tool)
            clock[0] += gap
            sessions.arrived("x")
            sessions.take("x")
    sessions.close("x")
