"""Sessions (scheduler/sessions.py): a finished request's path stays pinned for its session's next turn, until the
turn comes, the time to live runs out, the session closes, or admission needs the slots."""
from __future__ import annotations

import pytest

from _engine_helpers import make_checkpoint
from radixserve.scheduler import Engine

GREEDY = dict(temperature=0.0, ignore_eos=True, max_new_tokens=4)
PATH = 96 + 4 - 1  # what a finished request of a 96-token history leaves cached (its last token was never computed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "sessions")


def _history(seed: int, length: int = 96) -> list[int]:
    return [(seed * 37 + 11 * j) % 400 + 20 for j in range(length)]


def _engine(ckpt: str, **config) -> Engine:
    """An engine whose sessions' clock stands still (pins expire only when a test moves it)."""
    engine = Engine(ckpt, num_threads=1, **config)
    engine.kv.sessions._clock = lambda: 0.0
    return engine


def _run(engine: Engine, prompt: list[int], **params) -> int:
    """Generate one request to its end; returns its cached tokens."""
    return engine.generate([prompt], dict(GREEDY, **params))[0].cached_tokens


def _flood(engine: Engine, num: int = 6) -> None:
    """Other agents' traffic: distinct prompts that need most of the pool."""
    engine.generate([_history(100 + i) for i in range(num)], GREEDY)


@pytest.mark.parametrize("session, agent_cache", [(None, True), ("agent-1", True), ("agent-1", False)])
def test_a_session_history_survives_other_traffic_until_its_next_turn(ckpt, session, agent_cache):
    engine = _engine(ckpt, kv_cache_tokens=320, max_running_requests=2, disable_agent_cache=not agent_cache)
    history = _history(1)
    _run(engine, history, session_id=session)
    _flood(engine)
    cached = _run(engine, history + [7, 8, 9], session_id=session)  # the next turn: history + the tool result
    stats = engine.stats()
    if session is None or not agent_cache:  # LRU evicted the history while the agent waited
        assert cached == 0 and stats["num_pins"] == 0
    else:
        assert cached == len(history) and stats["num_pins_used"] == 1 and stats["num_pins"] == 1
        assert stats["num_pins_reclaimed"] == 0
    engine.check_integrity()


def test_pins_end_with_their_time_to_live_and_with_the_session(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    sessions = engine.kv.sessions
    now = [0.0]
    sessions._clock = lambda: now[0]
    engine.open_session("a")
    assert engine.open_session() != engine.open_session()  # new ids
    _run(engine, _history(2), session_id="a")
    _run(engine, _history(3), session_id="b")  # a session opened by its first request
    stats = engine.stats()
    assert stats["num_pins"] == 2 and stats["pinned_slots"] == 2 * PATH and stats["locked_slots"] == 2 * PATH
    assert engine.close_session("b") and not engine.close_session("b")
    assert engine.stats()["num_pins"] == 1
    now[0] += 1000.0  # past any time to live
    engine.step()
    stats = engine.stats()
    assert stats["num_pins"] == 0 and stats["num_pins_expired"] == 1 and stats["locked_slots"] == 0
    assert stats["free_slots"] + stats["evictable_slots"] == stats["total_slots"]
    assert stats["num_sessions"] == 0  # idle past the timeout as well: closed
    engine.check_integrity()


def test_an_expired_pin_stays_while_memory_has_room_and_goes_under_pressure(ckpt):
    """The time to live ends a pin only under memory pressure (an admission reclaimed pins in the last
    PRESSURE_WINDOW_S), or MAX_TTL_S after it was made in any case."""
    from radixserve.scheduler import sessions as sessions_mod

    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    sessions = engine.kv.sessions
    now = [0.0]
    sessions._clock = lambda: now[0]
    _run(engine, _history(2), session_id="a")
    _run(engine, _history(3), session_id="b")
    assert sessions._pins["a"].expires < sessions_mod.MAX_TTL_S / 2
    now[0] = sessions._pins["a"].expires + 1.0
    engine.step()
    assert set(sessions._pins) == {"a", "b"}  # past its time to live, but the pool has room: kept
    sessions.reclaim(0)  # an admission needed pins' slots just now: pressure
    now[0] += 1.0
    engine.step()
    assert set(sessions._pins) == set() and engine.stats()["num_pins_expired"] == 2
    _run(engine, _history(4), session_id="a")
    now[0] += sessions_mod.PRESSURE_WINDOW_S + 1.0  # the pressure is over: a new pin outlives its time to live...
    made = now[0]
    _run(engine, _history(5), session_id="c")
    now[0] = made + sessions_mod.MAX_TTL_S - 1.0
    engine.step()
    assert "c" in sessions._pins
    now[0] = made + sessions_mod.MAX_TTL_S  # ... until MAX_TTL_S after it was made
    engine.step()
    assert "c" not in sessions._pins
    engine.check_integrity()


def test_the_time_to_live_grows_with_the_recompute_cost(ckpt):
    engine = _engine(ckpt, kv_cache_tokens=2048)
    sessions = engine.kv.sessions
    sessions.observe_prefill = lambda *args: None
    sessions.prefill_s_per_token = 4e-3
    _run(engine, _history(4, 32), session_id="short")
    _run(engine, _history(5, 320), session_id="long")
    short, long = sessions._pins["short"].expires, sessions._pins["long"].expires
    assert short == pytest.approx(50 * 35 * 4e-3) and long == pytest.approx(50 * 323 * 4e-3)  # 7 s and 64.6 s


def test_pins_never_starve_admission(ckpt):
    """A pool full of pinned histories: a request that needs their slots is admitted, the pins go."""
    engine = _engine(ckpt, kv_cache_tokens=320, max_running_requests=4)
    for i in range(3):
        _run(engine, _history(10 + i), session_id=f"s{i}")
    stats = engine.stats()
    assert stats["pinned_slots"] == 3 * PATH and stats["free_slots"] + stats["evictable_slots"] < 100
    rid = engine.add_request(_history(20, 200), GREEDY)
    finished = []
    for _ in range(50):  # bounded: a starved request must fail the test, not hang it
        finished += [d.result for d in engine.step() if d.rid == rid and d.finished]
        if finished:
            break
    assert finished and finished[0].finish_reason == "length" and len(finished[0].output_ids) == 4
    assert engine.stats()["num_pins_reclaimed"] >= 2
    engine.check_integrity()
    assert engine.flush_cache() and engine.stats()["free_slots"] == engine.stats()["total_slots"]


def test_an_aborted_request_leaves_no_pin_and_bad_session_ids_are_refused(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024)
    rid = engine.add_request(_history(6), dict(GREEDY, session_id="x"))
    engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["num_pins"] == 0
    for bad in ("", 5, "x" * 257):
        with pytest.raises(ValueError, match="session_id"):
            engine.add_request([1, 2, 3], dict(GREEDY, session_id=bad))


def test_a_dsl_program_run_is_a_session(ckpt):
    """Each run opens a session, its calls carry it (the second gen finds the first's history pinned), and the
    session closes when the function returns."""
    from radixserve.lang import Runtime, function, gen

    @function
    def two_steps(s, question):
        s += question
        s += gen("a", max_tokens=4)
        s += " then"
        s += gen("b", max_tokens=4)

    engine = _engine(ckpt, kv_cache_tokens=1024)
    runtime = Runtime(engine=engine)
    try:
        state = two_steps.run(question="a question that is long enough to fill a few pages of cache " * 3,
                              backend=runtime, temperature=0.0)
        assert state["a"] is not None and state["b"] is not None
        stats = engine.stats()
        assert stats["num_pins_pinned"] == 2 and stats["num_pins_used"] == 1  # the second gen took the first's pin
        assert stats["num_sessions"] == 0 and stats["num_pins"] == 0  # closed at return
    finally:
        runtime.shutdown()
    engine.check_integrity()


def test_a_final_answer_keeps_the_pin_only_briefly(ckpt):
    engine = _engine(ckpt, kv_cache_tokens=1024)
    sessions = engine.kv.sessions
    sessions.observe_prefill = lambda *args: None
    sessions.prefill_s_per_token = 0.01  # a 99-token path: 50 x 0.99 s
    _run(engine, _history(7), session_id="agent")
    assert sessions._pins["agent"].expires == 49.5
    assert engine.settle_session("agent") and sessions._pins["agent"].expires == 2.0
    assert not engine.settle_session("nobody") and engine.stats()["num_pins_settled"] == 1


def test_a_warm_up_of_the_next_turn_moves_the_pin_and_is_no_return(ckpt):
    """The server's prefetch of the history as the next turn renders it (a prefix-only request naming the session,
    frontend/rewrite_prefetch.py) is not the agent coming back: no return gap, no pin used, the tool named stays.
    The pin moves to the rendering it computed, which the next turn then hits whole; the next turn's return gap is
    counted from the last turn's finish, after its tool."""
    engine = _engine(ckpt, kv_cache_tokens=320, max_running_requests=2)
    sessions = engine.kv.sessions
    now = [0.0]
    sessions._clock = lambda: now[0]
    turn = _history(3)
    _run(engine, turn, session_id="agent")
    assert engine.settle_session("agent", "search")
    rendered = turn[:60] + _history(4, 50)  # the template rewrote the history from token 60 on
    now[0] = 0.5
    engine.generate([rendered], dict(GREEDY, max_new_tokens=0, session_id="agent"))
    stats = engine.stats()
    assert (stats["num_pins"], stats["num_pins_pinned"], stats["num_pins_used"]) == (1, 1, 0)
    assert len(sessions.gaps.all) == 0 and stats["pinned_slots"] == len(rendered)
    _flood(engine)
    now[0] = 3.0
    assert _run(engine, rendered + [7, 8, 9], session_id="agent") == len(rendered)
    stats = engine.stats()
    assert stats["num_pins_used"] == 1 and stats["num_tool_returns"] == 1 and sessions.gaps.all.remaining(0.0) == 3.0
    engine.check_integrity()
