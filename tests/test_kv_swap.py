"""The session swap tier (scheduler/kv_swap.py, kernels/kv_files.py): a session's history copied to disk as its
requests finish, and read back bit for bit when the tree lost it."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _engine_helpers import make_checkpoint
from radixserve.kernels.attention.kv_int8 import Int8KV
from radixserve.kernels.kv_files import KVFiles
from radixserve.scheduler import Engine
from radixserve.scheduler.kv_swap import SessionSwap, common_prefix

GREEDY = dict(temperature=0.0, ignore_eos=True, max_new_tokens=4)
SWAP_GIB = 1e-3  # ~2k tokens of the tiny model's 512 bytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "kv_swap")


def _history(seed: int, length: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 400 + 20 for j in range(length)]


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_is_the_longest_shared_head(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix(a, b) == n


class _Pool:
    """A stand-in for the pool and its files: slot -> the value of the token computed there."""

    bytes_per_token = 1

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.files: dict[int, list[int]] = {}

    def write(self, key, start, slots):
        self.files[key] = self.files.get(key, [])[:start] + [self.slots[s] for s in slots]

    def read(self, key, start, slots):
        for i, s in enumerate(slots):
            self.slots[s] = self.files[key][start + i]

    def remove(self, key):
        del self.files[key]

    def close(self):
        self.files.clear()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 30)), min_size=1, max_size=25),
       st.integers(20, 120))
def test_the_tier_holds_each_sessions_last_history_within_its_capacity(saves, capacity):
    """Random turns of three sessions (a turn keeps `keep` tenths of the session's last history, rewritten after
    that, and adds tokens): what extent / load give back is always the session's last saved history, the files
    hold exactly the tokens counted, and the tier never holds more than its capacity."""
    pool = _Pool()
    swap = SessionSwap(pool, capacity)
    last: dict[str, list[int]] = {}
    for turn, (sid_num, keep, add) in enumerate(saves):
        sid = f"s{sid_num}"
        old = last.get(sid, [])
        ids = old[:len(old) * keep // 2] + [1000 * turn + j for j in range(add)]
        slots = [10_000 * turn + j for j in range(len(ids))]
        pool.slots.update({s: ("kv", t, i) for i, (s, t) in enumerate(zip(slots, ids))})
        swap.save(sid, None, ids, slots)
        last[sid] = ids
        assert swap.num_tokens == sum(len(f) for f in pool.files.values()) <= swap.peak_tokens <= capacity
    for sid, ids in last.items():
        held = swap.extent(sid, None, ids + [7])
        assert held in (0, len(ids))  # the whole last history, or nothing when it was dropped for room
        if held:
            assert swap.extent(sid, "other-salt", ids) == 0
            swap.load(sid, 0, list(range(-held, 0)))
            assert [pool.slots[s] for s in range(-held, 0)] == [("kv", t, i) for i, t in enumerate(ids)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_files_give_back_the_pool_rows_bit_for_bit(tmp_path, dtype):
    shape = (3, 40, 2, 8)  # layers, slots, kv heads, head dim
    gen = torch.Generator().manual_seed(0)

    def pool():
        x = torch.randn(shape, generator=gen)
        return Int8KV.of(x) if dtype == "int8" else x.to(getattr(torch, dtype))

    k, v = pool(), pool()
    files = KVFiles(k, v, str(tmp_path))
    planes = [k.data, k.scale, v.data, v.scale] if dtype == "int8" else [k, v]
    assert files.bytes_per_token == sum(p[:, 0].numel() * p.element_size() for p in planes)
    files.write(7, 0, [3, 9, 1, 30])
    files.write(7, 2, [5, 6, 11])  # the history diverged after 2 tokens: cut there, then appended
    before = [p.clone() for p in planes]
    files.read(7, 1, [20, 21, 22, 23])  # stored tokens 1..4: slots 9, 5, 6, 11 as they were
    for p, b in zip(planes, before):
        assert torch.equal(p[:, [20, 21, 22, 23]], b[:, [9, 5, 6, 11]])
        assert torch.equal(p[:, :20], b[:, :20]) and torch.equal(p[:, 24:], b[:, 24:])
    with pytest.raises(OSError, match="ends first"):
        files.read(7, 3, [0, 1, 2])
    assert files.num_bytes == 5 * files.bytes_per_token and os.listdir(tmp_path) == []  # unlinked from the start
    files.write(8, 0, [0])
    files.remove(7)
    assert files.num_bytes == files.bytes_per_token
    files.close()
    assert files.num_bytes == 0


def _engine(ckpt: str, **config) -> Engine:
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=320, max_running_requests=2, **config)
    engine.kv.sessions._clock = lambda: 0.0
    return engine


def _rows(engine: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V rows of the cached path of `ids` (all of it cached)."""
    slots, _ = engine.kv.tree.match_prefix(ids, record_hit=False)
    assert len(slots) == len(ids)
    return engine.runner.k_cache[:, slots].clone(), engine.runner.v_cache[:, slots].clone()


def _turns(engine: Engine, flood: int) -> tuple[int, list[int]]:
    """A session's turn, other traffic that needs the pool (`flood` tokens: its pin is reclaimed), and the next
    turn; returns the next turn's cached tokens and its output. The history's K/V rows, as the first turn computed
    them, are the ones the next turn finds."""
    history = _history(1, 200)
    first = engine.generate([history], dict(GREEDY, session_id="agent"))[0]
    computed = _rows(engine, history)
    if flood:
        engine.generate([_history(50, flood)], GREEDY)
    second = engine.generate([history + first.output_ids + [5, 6, 7]], dict(GREEDY, session_id="agent"))[0]
    if second.cached_tokens >= len(history):
        assert all(torch.equal(a, b) for a, b in zip(_rows(engine, history), computed))
    engine.check_integrity()
    return second.cached_tokens, second.output_ids


def test_a_history_the_pool_lost_comes_back_from_the_tier(ckpt, tmp_path):
    reference = _engine(ckpt)
    cached, want = _turns(reference, 0)
    assert cached == 203  # nothing evicted: the tree held it
    plain = _engine(ckpt)
    cached, out = _turns(plain, 300)
    assert cached < 32 and plain.stats()["num_pins_reclaimed"] == 1 and out == want
    engine = _engine(ckpt, kv_swap_space=SWAP_GIB, kv_swap_dir=str(tmp_path))
    cached, out = _turns(engine, 300)
    stats = engine.stats()
    assert cached == 203 and out == want  # the same greedy tokens: the KV read back is what was computed
    assert stats["num_pins_reclaimed"] == 1 and stats["swap_restores"] == 1 and stats["swap_restored"] > 170
    # written when the flood's admission first evicted: the first turn's path; the second's waits for an eviction
    assert stats["swap_saved"] == stats["swap_tokens"] == 203
    engine.generate([_history(60, 300)], GREEDY)
    stats = engine.stats()
    assert stats["swap_saved"] == stats["swap_tokens"] == stats["swap_peak_tokens"] == 210  # the turn added 7
    files = engine.kv.swap._store
    assert files.num_bytes == 210 * files.bytes_per_token and os.listdir(tmp_path) == []
    engine.close_session("agent")
    assert engine.stats()["swap_tokens"] == 0 and files.num_bytes == 0
    engine.shutdown()
    assert engine.kv.swap is None


def test_the_tier_is_off_with_the_agent_cache_and_never_reclaims_a_pin(ckpt):
    off = _engine(ckpt, kv_swap_space=SWAP_GIB, disable_agent_cache=True)
    assert off.kv.swap is None and "swap_tokens" not in off.stats()
    engine = _engine(ckpt, kv_swap_space=SWAP_GIB)
    history = _history(1, 200)
    engine.generate([history], dict(GREEDY, session_id="agent"))
    engine.generate([_history(50, 300)], GREEDY)  # the agent's history is gone from the tree (its pin reclaimed)
    engine.kv.sessions._clock = lambda: 100.0  # that reclaim is long past: the next finished turn is pinned
    engine.generate([_history(2, 250)], dict(GREEDY, session_id="other"))  # pinned: 253 of 320 slots held
    assert engine.stats()["pinned_slots"] == 253
    out = engine.generate([history + [5]], dict(GREEDY, session_id="agent"))[0]
    stats = engine.stats()
    # restoring 200 tokens needs more than the free and evictable slots: skipped, the turn computes its history
    assert stats["swap_restores"] == 0 and out.cached_tokens < 32
    assert stats["num_pins_reclaimed"] == 2  # the flood took the agent's, the turn's own prefill the other's
    engine.check_integrity()


def test_nothing_is_written_until_eviction_and_the_least_recently_saved_goes_when_full(ckpt):
    engine = _engine(ckpt, kv_swap_space=250 * 512 / 2**30)  # 250 tokens: one 200-token history at a time
    engine.generate([_history(ord("a"), 200)], dict(GREEDY, session_id="a"))
    engine.generate([_history(9, 50)], GREEDY)
    assert engine.stats()["swap_saved"] == 0  # the pool had room: no eviction, no write
    engine.generate([_history(ord("b"), 200)], dict(GREEDY, session_id="b"))  # its admission evicts: "a" written
    assert engine.stats()["swap_saved"] == 203
    engine.generate([_history(10, 300)], GREEDY)  # "b" written, "a" dropped for room
    stats = engine.stats()
    assert stats["swap_sessions"] == 1 and stats["swap_dropped"] == 1 and stats["swap_tokens"] == 203
    assert engine.kv.swap.extent("b", None, _history(ord("b"), 200)) == 200


def test_a_failing_disk_costs_the_tier_never_a_request_or_a_slot(ckpt, monkeypatch):
    with pytest.raises(ValueError, match="is not a directory"):
        Engine(ckpt, num_threads=1, kv_cache_tokens=320, kv_swap_space=SWAP_GIB, kv_swap_dir="/nonexistent/dir")
    engine = _engine(ckpt, kv_swap_space=SWAP_GIB)
    history = _history(1, 200)
    engine.generate([history], dict(GREEDY, session_id="agent"))
    engine.generate([_history(50, 300)], GREEDY)
    files = engine.kv.swap._store

    def fail(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(files, "read", fail)
    out = engine.generate([history + [5]], dict(GREEDY, session_id="agent"))[0]
    assert out.finish_reason == "length" and out.cached_tokens < 32  # computed again, the file dropped
    monkeypatch.setattr(files, "write", fail)
    engine.generate([_history(3, 50)], dict(GREEDY, session_id="other"))
    engine.generate([_history(51, 300)], GREEDY)  # evicts: the agent's and the other's paths fail to be written
    stats = engine.stats()
    assert stats["swap_restores"] == 0 and stats["swap_sessions"] == stats["swap_tokens"] == 0
    engine.check_integrity()
    engine.flush_cache()
    assert engine.stats()["free_slots"] == engine.stats()["total_slots"]  # no slot leaked by the failed restore
