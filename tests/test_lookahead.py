"""Eviction that looks ahead (issue 38 item 4): what a waiting request will match is evicted last, and a closed
session's own path first. Both are preferences in the radix tree's eviction order (RadixCache.hint / demote); the
radix state machine (tests/test_radix_stateful.py) checks that a hinted page goes only when nothing unhinted is
left, and the KV identity, after every step."""
from __future__ import annotations

import pytest

from _engine_helpers import make_checkpoint
from radixserve.scheduler import Engine

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "lookahead")


def _prompt(seed: int, length: int = 100) -> list[int]:
    return [(seed * 37 + 11 * j) % 400 + 20 for j in range(length)]


def _cache(engine: Engine, prompt: list[int], **params) -> None:
    engine.generate([prompt], dict(GREEDY, max_new_tokens=1, **params))


def _run_until_done(engine: Engine) -> dict:
    results = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                results[delta.rid] = delta.result
    engine.check_integrity()
    return results


@pytest.mark.parametrize("lookahead", [True, False])
def test_a_waiting_requests_prefix_outlives_older_and_newer_paths_nobody_waits_for(ckpt, lookahead):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256, max_running_requests=1)
    if not lookahead:
        engine.kv.hint = lambda waiting: None  # today's LRU alone: the control
    wanted, other = _prompt(1), _prompt(2)
    _cache(engine, wanted)  # older
    _cache(engine, other)  # newer: LRU would evict `wanted` first
    engine.add_request(_prompt(3, 20), dict(GREEDY, max_new_tokens=60), rid="long")  # needs ~80 of 56 free slots
    engine.step()
    engine.add_request(wanted + [7, 8], dict(GREEDY, max_new_tokens=2), rid="continuation")  # waits for the slot
    results = _run_until_done(engine)
    hit = results["continuation"].cached_tokens
    if lookahead:
        assert hit == len(wanted), hit  # the whole prefix survived: the unhinted path went instead
        assert engine.kv.tree.match_length(other + [0], None) < len(other)
    else:
        assert hit < len(wanted), hit  # the control: without the hint the older path is what LRU evicts


def test_a_closed_sessions_path_goes_before_older_paths(ckpt):
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256)
    engine.kv.sessions._clock = lambda: 0.0
    older, session_path = _prompt(4), _prompt(5)
    _cache(engine, older)
    engine.open_session("s")
    _cache(engine, session_path, session_id="s")
    assert engine.close_session("s")  # nobody will continue it: its path is demoted
    engine.generate([_prompt(6, 60)], dict(GREEDY, max_new_tokens=30))  # needs more than the free slots
    engine.check_integrity()
    assert engine.kv.tree.match_length(older + [0], None) == len(older)
    assert engine.kv.tree.match_length(session_path + [0], None) < len(session_path)


def test_demoted_paths_go_first_in_the_order_of_their_ranks():
    """A closed session's path (rank 0), then the paths of sessions expected back last (ranks 1, 2...), then LRU;
    a demoted path's shared ancestor keeps its rank (another path still uses it)."""
    from radixserve.radix import KVAllocator, RadixCache

    allocator = KVAllocator(64, 1)
    tree = RadixCache(allocator, page_size=1)
    paths = {name: [base, base + 1, base + 2] for name, base in (("a", 100), ("b", 200), ("c", 300), ("d", 400))}
    for tokens in paths.values():
        tree.insert(tokens, allocator.alloc(3))
    shared = list(tree.match_prefix([100, 101], record_hit=False)[0])
    tree.insert([100, 101, 9], shared + allocator.alloc(1))  # a's first two tokens now shared with another path
    nodes = {name: tree.match_prefix(tokens, record_hit=False)[1] for name, tokens in paths.items()}
    assert tree.demote(nodes["c"], 2) == 3 and tree.demote(nodes["b"], 1) == 3 and tree.demote(nodes["d"], 0) == 3
    assert tree.demote(nodes["a"], 3) == 1  # its own last token only
    order = []
    while tree.evictable_size:
        tree.evict(1)
        order += [name for name, tokens in paths.items() if tree.match_length(tokens, None) < 3 and name not in order]
    assert order == ["d", "b", "c", "a"] and tree.match_length([100, 101, 9], None) == 0
    tree.check_integrity()


def test_the_agent_cache_flag_turns_look_ahead_and_program_levels_off(ckpt):
    """--disable-agent-cache (the agent-trace baseline): a waiting request's prefix is not hinted, and admission
    sets program levels aside; the sessions still open and close."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256, max_running_requests=1, disable_agent_cache=True)
    _cache(engine, _prompt(1))
    engine.add_request(_prompt(3, 20), dict(GREEDY, max_new_tokens=4), rid="running")
    engine.step()
    engine.add_request(_prompt(1) + [7], dict(GREEDY, max_new_tokens=1), rid="waiting")
    engine.step()
    assert engine.planner.waiting and engine.planner.waiting[0].hint_node is None
    assert engine.kv.tree.match_prefix(_prompt(1), record_hit=False)[1].hint_ref == 0
    assert engine.policy.share.las is False
    for seed in (4, 5):  # admissions that evict cached paths: memory under pressure, but program scheduling is off
        _cache(engine, _prompt(seed))
    engine.add_request(_prompt(6), dict(GREEDY, max_new_tokens=1), rid="after")
    engine.step()
    assert engine.kv.sessions.under_pressure() and engine.policy.pressed is False
    assert engine.open_session("s") == "s" and engine.close_session("s")
    _run_until_done(engine)


def test_under_memory_pressure_program_levels_yield_and_the_overtake_bound_tightens(ckpt):
    """With the agent cache on, an admission that evicts cached paths sets program levels aside and makes the
    policy admit a request overtaken once first (scheduler/policy.py `pressed`); without pressure neither."""
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=256, max_running_requests=1)
    _cache(engine, _prompt(1))
    assert engine.policy.pressed is False and engine.policy.share.las is True
    for seed in (2, 3):  # 100-token prompts in a 256-slot pool: the second evicts the first
        _cache(engine, _prompt(seed))
    engine.add_request(_prompt(4), dict(GREEDY, max_new_tokens=1), rid="next")
    engine.step()
    assert engine.kv.sessions.under_pressure()
    assert engine.policy.pressed is True and engine.policy.share.las is False
    _run_until_done(engine)
