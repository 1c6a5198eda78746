"""frontend/tenants.py and frontend/tenant_limits.py without a server: key resolution, the limits' arithmetic
(a fake clock), session scoping. The same over real HTTP: tests/test_http_tenants.py."""
from __future__ import annotations

import json

import pytest

from radixserve.frontend.errors import APIError
from radixserve.frontend.tenant_limits import TenantLimiter
from radixserve.frontend.tenants import OPEN, Tenant, TenantLimits, Tenants, engine_session
from radixserve.scheduler.checks import MAX_SESSION_ID


class FakeEngine:
    def __init__(self) -> None:
        self.tenant_slots: dict[str, int] = {}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(**kwargs) -> tuple[TenantLimiter, FakeEngine, Clock]:
    engine, clock = FakeEngine(), Clock()
    return TenantLimiter(engine, max_running=4, max_queued=10, total_slots=1000, clock=clock, **kwargs), engine, clock


def tenant(**limits) -> Tenant:
    return Tenant(name="t", limits=TenantLimits(**limits))


def refused(lim: TenantLimiter, t: Tenant, num: int = 1) -> APIError:
    with pytest.raises(APIError) as info:
        lim.admit(t, num, "n")
    return info.value


def test_keys_file_and_single_key(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": {"tenant": "a", "weight": 2}, "k2": {"tenant": "default", "weight": 5},
                                "k3": {"tenant": "a", "weight": 2, "admin": True}}))
    tenants = Tenants.from_config("single", str(path))
    assert tenants.authenticate({"authorization": "Bearer k1"}) == Tenant("a", 2.0)
    assert tenants.authenticate({"x-api-key": "k3"}).admin
    single = tenants.authenticate({"authorization": "bearer  single "})
    assert single == Tenant("default", 5.0, admin=True)  # the file's weight for default, as an admin
    assert not tenants.authenticate({"x-api-key": "k2"}).admin
    assert tenants.engine_settings() == {"a": {"weight": 2.0, "max_running_requests": None},
                                         "default": {"weight": 5.0, "max_running_requests": None}}
    for headers in ({}, {"authorization": "Bearer k1x"}, {"authorization": "k1"}, {"x-api-key": "K1"}):
        with pytest.raises(APIError) as info:
            tenants.authenticate(headers)
        assert info.value.status == 401
    with pytest.raises(ValueError, match="also a key"):
        Tenants.from_config("k1", str(path))
    assert Tenants().authenticate({}) is OPEN and OPEN.admin


def test_running_and_queued_cap():
    lim, _, _ = limiter()
    both = tenant(max_running_requests=2, max_queued_requests=1)
    lim.admit(both, 2, "n")
    lim.admit(both, 1, "n")
    error = refused(lim, both)
    assert error.status == 429 and error.headers["Retry-After"] == "1"
    lim.release("t", 1)
    lim.admit(both, 1, "n")
    assert refused(lim, both, 4).status == 400  # more than it may ever have at once
    assert lim.cap(tenant(max_queued_requests=0)) == 4  # the server's running limit
    assert lim.cap(tenant(max_running_requests=1)) == 11  # the server's queue
    assert lim.cap(tenant()) is None
    assert lim.refused[("t", "requests")] == 1


def test_tokens_per_minute_window_and_retry_after():
    lim, _, clock = limiter()
    t = tenant(tokens_per_minute=100)
    lim.admit(t, 1, None)
    lim.charge("t", 60)
    clock.now += 10
    lim.charge("t", 50)  # 110 in the window
    error = refused(lim, t)
    assert error.headers["Retry-After"] == "50"  # the first 60 age out 60 s after they were charged
    clock.now += 49.5
    assert refused(lim, t).headers["Retry-After"] == "1"
    clock.now += 0.5
    lim.admit(t, 1, None)  # 50 left in the window


def test_kv_share_reads_the_engines_figure():
    lim, engine, _ = limiter()
    t = tenant(max_kv_share=0.25)
    engine.tenant_slots = {"t": 249, "other": 900}
    lim.admit(t, 1, None)
    engine.tenant_slots = {"t": 250}
    error = refused(lim, t)
    assert error.status == 429 and "250 of the 1000" in error.message


def test_engine_session_is_per_tenant():
    assert engine_session("s", "default") == "s"  # a server without keys names sessions as before
    assert engine_session("s", "a") == "a/s" != engine_session("s", "b")
    long = "x" * MAX_SESSION_ID
    scoped = engine_session(long, "a" * 64)
    assert len(scoped) <= MAX_SESSION_ID and scoped != engine_session(long[:-1] + "y", "a" * 64)


# -- the engine's running cap ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from _engine_helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory, "tenant-caps")


def test_engine_cap_waits_without_preempting_for_it(ckpt):
    """A tenant at its cap waits while others run; nothing is preempted for its waiting work, even when its share
    (weight 10, so the lowest counter) puts it first in admission order and the running slots are full."""
    import torch

    from radixserve.scheduler import Engine, SamplingParams

    torch.set_num_threads(1)
    engine = Engine(ckpt, num_threads=1, kv_cache_tokens=1024, max_running_requests=2, chunked_prefill_size=64)
    engine.set_tenants({"a": {"weight": 10.0, "max_running_requests": 1}, "b": {"weight": 1.0}})
    for i, tenant in enumerate(["a", "a", "b", "b"]):
        engine.add_request(list(range(10 + 20 * i, 30 + 20 * i)), SamplingParams(
            max_new_tokens=12, temperature=0.0, ignore_eos=True, tenant=tenant), rid=f"{tenant}{i}")
    most_a, finished = 0, 0
    while engine.has_unfinished():
        finished += sum(d.finished for d in engine.step())
        most_a = max(most_a, sum(r.params.tenant == "a" for r in engine.planner.running))
        assert engine.stats()["tenant_slots"].get("a", 0) <= 20 + 12
    stats = engine.stats()
    assert finished == 4 and most_a == 1
    assert stats["num_retractions"] == 0, stats["num_retractions"]
    assert stats["tenant_caps"] == {"a": 1} and stats["tenant_weights"] == {"a": 10.0, "b": 1.0}
    engine.check_integrity()
    engine.shutdown()
