"""Program-level LAS against the cache (scheduler/fair_share.py, issue 38 item 5): a program is charged for what it
asked for, not for its history recomputed after the cache lost it; under memory pressure levels are set aside; a
continuation whose history is held goes at level 0."""
from __future__ import annotations

from radixserve.scheduler.fair_share import LAS_QUANTUM, FairShare
from radixserve.scheduler.planner import BatchItem
from radixserve.scheduler.req import Req
from radixserve.scheduler.sampling_params import SamplingParams


def _req(session: str, prompt_len: int, name: str = "r") -> Req:
    params = SamplingParams.from_any({"session_id": session, "max_new_tokens": 4}, 16)
    return Req(rid=f"{name}-{session}-{prompt_len}", prompt_ids=[1] * prompt_len, params=params, seed=0,
               arrival_step=0, arrival_time=0.0)


def _prefill(share: FairShare, req: Req, start: int, num: int) -> None:
    req.kv_len = start
    share.charge_batch([BatchItem(req, num, sample=False)])


def test_a_history_recomputed_after_eviction_is_not_charged_to_its_program_again():
    share = FairShare()
    first = _req("agent", 3000)
    _prefill(share, first, 0, 3000)  # its first turn: 3,000 tokens asked for
    assert share.level(first) == 1  # 2,048 <= 3,000 < 4,096
    tenant_after_first = share.counter("default")
    second = _req("agent", 3100, "turn2")
    _prefill(share, second, 0, 3100)  # the cache lost the history: all of it computed again, 100 new
    assert share.counter("default") == tenant_after_first + 3100  # the tenant is charged what the engine ran
    assert share.level(second) == 1  # the program only its 100 new tokens (with both: 6,100, level 2)
    other = _req("other", 3000)
    _prefill(share, other, 0, 1000)  # another program's positions are its own
    _prefill(share, other, 1000, 2000)  # chunks of one prompt continue it
    assert share.level(other) == 1 and share._service["other"] == 3000


def test_under_memory_pressure_the_levels_are_set_aside():
    share = FairShare()
    long_run, short = _req("long", 8), _req("short", 8)
    _prefill(share, long_run, 0, int(4 * LAS_QUANTUM))
    assert share.order([long_run, short]) == [short, long_run]
    share.las = False  # the planner's: admissions evict cached paths (Sessions.under_pressure)
    assert share.level(long_run) == 0 and share.order([long_run, short]) == [long_run, short]


def test_a_continuation_whose_history_is_held_goes_at_level_zero():
    share = FairShare()
    turn1 = _req("long", 5000)
    _prefill(share, turn1, 0, 5000)
    turn2, short = _req("long", 5200, "turn2"), _req("short", 8)
    assert share.level(turn2) > 0
    held = {turn2.rid: 5000, short.rid: 0}  # its whole history is cached (pinned): only the tool result is new
    assert share.order([short, turn2], lambda r: held[r.rid]) == [short, turn2]  # ties keep the cache-aware order
    assert share.order([turn2, short], lambda r: held[r.rid]) == [turn2, short]
    lost = {turn2.rid: 1500, short.rid: 0}  # only the app's prompt is left: it waits for its level
    assert share.order([turn2, short], lambda r: lost[r.rid]) == [short, turn2]
