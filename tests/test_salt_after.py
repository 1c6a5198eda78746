"""A salt that starts after a shared part (issue 41 item 4): `cache_salt_after` keys a request's tokens from that
position on apart from every other salt's (Req.tree_ids), so tenants share a common system prompt's KV and nothing
after it. Counts, on the real engine: a probe from another tenant repeating a private suffix gets no cached token
past the boundary; the same tenant does."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _engine_helpers import make_checkpoint
from radixserve.scheduler import Engine, SamplingParams
from radixserve.scheduler.req import Req

SYSTEM = [(11 * j) % 300 + 20 for j in range(64)]
PRIVATE = [(7 * j) % 200 + 40 for j in range(32)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = Engine(make_checkpoint(tmp_path_factory, "salt_after"), num_threads=1, kv_cache_tokens=4096)
    yield engine
    engine.shutdown()


def _cached(engine: Engine, prompt: list[int], salt: str | None, after: int | None = None) -> int:
    params = dict(temperature=0.0, max_new_tokens=2, ignore_eos=True, cache_salt=salt, cache_salt_after=after)
    result = engine.generate([prompt], params)[0]
    engine.check_integrity()
    return result.cached_tokens


def test_tenants_share_the_system_prompt_and_nothing_after_it(engine):
    engine.flush_cache()
    first = _cached(engine, SYSTEM + PRIVATE, "tenant-a", after=len(SYSTEM))
    assert first == 0
    probe = _cached(engine, SYSTEM + PRIVATE, "tenant-b", after=len(SYSTEM))  # the same suffix, another tenant
    assert probe == len(SYSTEM)  # the shared part, and not one private token
    again = _cached(engine, SYSTEM + PRIVATE + [5], "tenant-a", after=len(SYSTEM))  # its own continuation
    assert again == len(SYSTEM + PRIVATE)
    plain = _cached(engine, SYSTEM + PRIVATE, None)  # unsalted: the public part only
    assert plain == len(SYSTEM)
    whole = _cached(engine, SYSTEM + PRIVATE, "tenant-c")  # a salt from the first token: nothing shared
    assert whole == 0


def test_sixty_four_tenants_compute_the_system_prompt_once(engine):
    engine.flush_cache()
    computed = 0
    for i in range(64):
        prompt = SYSTEM + [(i * 13 + j) % 300 + 20 for j in range(8)]
        computed += len(prompt) - _cached(engine, prompt, f"tenant-{i}", after=len(SYSTEM))
    assert computed == len(SYSTEM) + 64 * 8


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 10_000), max_size=40), start=st.integers(1, 50), end=st.integers(0, 50),
       salts=st.sampled_from([("a", "b"), ("x", "y")]))
def test_tree_ids_share_exactly_the_tokens_before_the_boundary(tokens, start, end, salts):
    reqs = [Req(rid=s, prompt_ids=tokens, params=SamplingParams(cache_salt=s, cache_salt_after=start), seed=0,
                arrival_step=0, arrival_time=0.0) for s in salts]
    a, b = (r.tree_ids(end) for r in reqs)
    cut = min(start, end, len(tokens))
    assert a[:cut] == b[:cut] == tokens[:cut]
    assert all(x != y and x > 2**32 for x, y in zip(a[cut:], b[cut:]))
    assert len(a) == min(end, len(tokens))


def test_cache_salt_after_needs_a_salt():
    with pytest.raises(ValueError, match="cache_salt_after needs a cache_salt"):
        SamplingParams(cache_salt_after=4)
