"""Load control of sessions (Sessions.starts, Planner._admit): while the server is behind, a request that would start a
session waits while the histories the started sessions bring back, the running requests and its own prompt exceed
`session_admission_ratio` pools; continuations, requests without a session and a start with nothing running never wait
for it, nor does any start on a server that keeps up."""
from __future__ import annotations

import pytest

from _engine_helpers import make_checkpoint
from radixserve.scheduler import Engine
from radixserve.scheduler.sessions import (ADMISSION_RATIO, BEHIND_LATCH_S, BEHIND_S, IDLE_TIMEOUT_S, MAX_START_WAIT_S,
                                           RETURN_HORIZON_S)

GREEDY = dict(temperature=0.0, ignore_eos=True, max_new_tokens=4)
LONG = dict(GREEDY, max_new_tokens=24)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "load_control")


def _prompt(seed: int, length: int = 96) -> list[int]:
    return [(seed * 37 + 11 * j) % 400 + 20 for j in range(length)]


def _engine(ckpt: str, now: list[float], behind: bool = True, **config) -> Engine:
    """Load control at its default ratio unless `config` says otherwise, the sessions' clock `now`; `behind`: the server
    counts as behind whenever anything waits (else the tiny model's queue would never take BEHIND_S)."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=320, max_running_requests=4, **config)
    engine.kv.sessions._clock = lambda: now[0]
    if behind:
        engine.kv.sessions.behind_s = 1e-12
    return engine


def _admission_steps(engine: Engine, rids: list[str], limit: int = 200) -> dict[str, int]:
    """Steps until every request of `rids` finished (bounded: a starved one fails the test); returns the step at which
    each was first running."""
    first: dict[str, int] = {}
    done: set[str] = set()
    for step in range(limit):
        for req in engine.planner.running:
            first.setdefault(req.rid, step)
        done |= {d.rid for d in engine.step() if d.finished}
        if done >= set(rids):
            return first
    raise AssertionError(f"not finished in {limit} steps: {set(rids) - done}")


def test_a_start_waits_while_the_running_and_returning_exceed_the_ratio(ckpt):
    now = [0.0]
    engine = _engine(ckpt, now, session_admission_ratio=0.5)  # 160 slots: one 96-token program at a time
    running = engine.add_request(_prompt(1), dict(LONG, session_id="a"))
    engine.step()  # "a" runs
    start = engine.add_request(_prompt(2), dict(GREEDY, session_id="b"))
    plain = engine.add_request(_prompt(3), GREEDY)  # no session: load control does not hold it
    first = _admission_steps(engine, [running, start, plain])
    finished_a = first[running] + 1 + 24  # "a" admitted, then one step per output token
    assert first[plain] <= 2 and first[start] >= finished_a - 1
    assert engine.stats()["num_starts_held"] == 1  # held over many steps, counted once
    engine.check_integrity()


def test_a_start_waits_at_most_max_start_wait(ckpt):
    """Programs that never end (or keep coming back) must not shut new ones out."""
    now = [0.0]
    engine = _engine(ckpt, now, session_admission_ratio=0.5)
    running = engine.add_request(_prompt(1), dict(LONG, session_id="a"))
    engine.step()
    start = engine.add_request(_prompt(2), dict(GREEDY, session_id="b"))
    engine.step()
    engine.step()
    assert [r.rid for r in engine.planner.running] == [running]  # held
    now[0] += MAX_START_WAIT_S
    engine.step()
    assert {r.rid for r in engine.planner.running} == {running, start}  # "a" still runs: the wait ran out
    _admission_steps(engine, [running, start])
    aborted = engine.add_request(_prompt(3), dict(LONG, session_id="c"))
    engine.step()
    engine.add_request(_prompt(4), dict(GREEDY, session_id="d"))
    engine.step()
    engine.abort(aborted)
    assert "d" in engine.kv.sessions._starting  # "d" was held, then it is aborted while it waits
    for rid in [r.rid for r in engine.planner.waiting]:
        engine.abort(rid)
    now[0] += IDLE_TIMEOUT_S + 1
    engine.step()
    assert not engine.kv.sessions._starting
    engine.check_integrity()


def test_continuations_and_starts_with_nothing_running_never_wait(ckpt):
    now = [0.0]
    engine = _engine(ckpt, now, session_admission_ratio=0.01)  # 3 slots: every start is over it
    engine.generate([_prompt(4)], dict(GREEDY, session_id="x"))  # nothing runs: "x" starts at once
    sessions = engine.kv.sessions
    assert not sessions.starts("x") and sessions.starts("y") and sessions.returning_tokens() == 96 + 4 - 1
    other = engine.add_request(_prompt(5), dict(LONG, session_id="y"))  # nothing runs: starts
    engine.step()
    assert [r.rid for r in engine.planner.running] == [other]
    turn = engine.add_request(_prompt(4) + [7, 8, 9], dict(GREEDY, session_id="x"))  # a continuation goes beside it
    first = _admission_steps(engine, [other, turn])
    assert first[turn] <= 2
    engine.check_integrity()


def test_an_away_history_counts_until_the_return_horizon_and_a_closed_one_not_at_all(ckpt):
    now = [0.0]
    engine = _engine(ckpt, now)
    sessions = engine.kv.sessions
    engine.generate([_prompt(6)], dict(GREEDY, session_id="p"))
    engine.generate([_prompt(7)], dict(GREEDY, session_id="q"))
    assert sessions.returning_tokens() == 2 * (96 + 4 - 1)
    now[0] += RETURN_HORIZON_S  # p and q away this long: no longer expected back
    assert sessions.returning_tokens() == 0
    engine.generate([_prompt(6) + [1, 2]], dict(GREEDY, session_id="p"))
    assert sessions.returning_tokens() == 96 + 2 + 4 - 1
    assert engine.close_session("p") and sessions.returning_tokens() == 0 and sessions.starts("p")
    engine.check_integrity()


@pytest.mark.parametrize("config", [dict(session_admission_ratio=0.0), dict(disable_agent_cache=True)])
def test_load_control_is_off_with_a_zero_ratio_and_without_the_agent_cache(ckpt, config):
    now = [0.0]
    engine = _engine(ckpt, now, **config)
    running = engine.add_request(_prompt(1), dict(LONG, session_id="a"))
    engine.step()
    start = engine.add_request(_prompt(2), dict(GREEDY, session_id="b"))
    assert not engine.kv.sessions.starts("b")
    first = _admission_steps(engine, [running, start])
    assert first[start] <= 2
    engine.check_integrity()


def test_a_server_that_keeps_up_holds_no_start_and_one_behind_holds_them_for_the_latch(ckpt):
    """Behind: the waiting queue's uncached prefill, at the measured cost per token, takes BEHIND_S; the holds last
    BEHIND_LATCH_S from the last step that saw it, so a burst's starts cannot slip in while the queue drains."""
    now = [0.0]
    engine = _engine(ckpt, now, behind=False, session_admission_ratio=0.5)
    sessions = engine.kv.sessions
    running = engine.add_request(_prompt(1), dict(LONG, session_id="a"))
    engine.step()
    start = engine.add_request(_prompt(2), dict(GREEDY, session_id="b"))
    assert sessions.behind_s == BEHIND_S and not sessions.starts("b")  # a queue of 96 tokens: far from BEHIND_S
    first = _admission_steps(engine, [running, start])
    assert first[start] <= 2 and sessions.starts_held == 0  # over the ratio, but the server keeps up: it starts
    running = engine.add_request(_prompt(3), dict(LONG, session_id="c"))
    engine.step()
    engine.add_request(_prompt(4), dict(GREEDY, session_id="d"))
    sessions.prefill_s_per_token = BEHIND_S / 50  # as if each token took that long: a 96-token queue is behind
    engine.step()
    assert sessions.starts("d") and [r.rid for r in engine.planner.running] == [running]  # held
    sessions.prefill_s_per_token = 1e-9  # the queue is short again...
    now[0] += BEHIND_LATCH_S - 1  # ...but within the latch: still held
    assert sessions.starts("d")
    now[0] += 2
    assert not sessions.starts("d")
    engine.step()
    assert len(engine.planner.running) == 2
    engine.check_integrity()


def test_load_control_is_on_by_default_and_a_bad_ratio_is_refused(ckpt):
    assert ADMISSION_RATIO > 0
    assert Engine(ckpt, num_threads=1, kv_cache_tokens=320).kv.sessions.admission_ratio == ADMISSION_RATIO
    with pytest.raises(ValueError, match="session_admission_ratio"):
        Engine(ckpt, num_threads=1, session_admission_ratio=-1.0)


def test_a_swap_tier_adds_its_tokens_to_the_room_for_histories(ckpt):
    """With a session swap tier (scheduler/kv_swap.py) the histories the pool cannot keep go to disk and come back as
    a copy, not a recompute: load control counts the tier's tokens besides the ratio's pools, and the start that
    waited above no longer waits."""
    now = [0.0]
    engine = _engine(ckpt, now, session_admission_ratio=0.5, kv_swap_space=200 * 512 / 2**30)
    assert engine.kv.history_room() == 0.5 * 320 + engine.kv.swap.capacity_tokens
    running = engine.add_request(_prompt(1), dict(LONG, session_id="a"))
    engine.step()
    start = engine.add_request(_prompt(2), dict(GREEDY, session_id="b"))
    first = _admission_steps(engine, [running, start])
    assert first[start] <= 2 and engine.stats()["num_starts_held"] == 0
