"""Schedule policies on hand-made queues (no model): order, dedup, anti-starvation, bounded cost."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.scheduler.kv_ops import PrefixKV
from radixserve.scheduler.policy import PolicyConfig, SchedulePolicy
from radixserve.scheduler.prefix_groups import PrefixGroups, block_key
from radixserve.scheduler.req import Req, ReqStatus
from radixserve.scheduler.sampling_params import SamplingParams

_counter = iter(range(10**9))


def make_req(prompt, salt=None, step=0):
    idx = next(_counter)
    return Req(rid=f"r{idx}", prompt_ids=list(prompt), params=SamplingParams(cache_salt=salt), seed=0,
               arrival_step=step, arrival_time=float(idx))


def admit(waiting, req):
    waiting.remove(req)
    req.status = ReqStatus.RUNNING


def cache(kv, tokens, salt=None):
    slots = kv.allocator.alloc(len(tokens))
    kv.tree.insert(tokens, slots, salt=salt)


def gsp_queue(rng, num_groups=3, per_group=4, sys_len=64, q_len=8):
    systems = [[rng.randrange(10, 4000) for _ in range(sys_len)] for _ in range(num_groups)]
    pairs = [(g, systems[g] + [rng.randrange(10, 4000) for _ in range(q_len)])
             for g in range(num_groups) for _ in range(per_group)]
    rng.shuffle(pairs)
    reqs = [make_req(p) for _, p in pairs]
    return reqs, {r.rid: g for (g, _), r in zip(pairs, reqs)}, systems


@pytest.fixture
def kv():
    return PrefixKV(50_000, 1, False, "lru-reuse")


def test_fcfs_keeps_arrival_order_with_retracted_first(kv):
    reqs = [make_req([1, 2, 3, i]) for i in range(5)]
    reqs[3].num_retractions = 1
    out = SchedulePolicy("fcfs", kv).order(reqs, 0)
    assert out == [reqs[3], reqs[0], reqs[1], reqs[2], reqs[4]]


def test_lpm_puts_the_longest_cached_prefix_first(kv):
    rng = random.Random(0)
    a, b, c = ([rng.randrange(10, 4000) for _ in range(40)] for _ in range(3))
    cache(kv, b[:30])
    cache(kv, c[:10])
    reqs = [make_req(a), make_req(c), make_req(b)]
    out = SchedulePolicy("lpm", kv).order(reqs, 0)
    assert out == [reqs[2], reqs[1], reqs[0]]


def test_lpm_does_not_stamp_the_tree(kv):
    tokens = list(range(100, 140))
    cache(kv, tokens)
    before = [(n.last_access, n.hit_count) for n in kv.tree._iter_nodes()]
    SchedulePolicy("lpm", kv).order([make_req(tokens + [5])], 0)
    assert [(n.last_access, n.hit_count) for n in kv.tree._iter_nodes()] == before


def test_dfs_weight_keeps_groups_together_heaviest_first(kv):
    rng = random.Random(1)
    reqs, group, _ = gsp_queue(rng, num_groups=3, per_group=4)
    extra = make_req(reqs[0].prompt_ids[:64] + [7] * 8)  # group of reqs[0] becomes the heaviest
    group[extra.rid] = group[reqs[0].rid]
    out = SchedulePolicy("dfs-weight", kv).order(reqs + [extra], 0)
    groups = [group[r.rid] for r in out]
    assert len(out) == 13
    assert groups[:5] == [group[reqs[0].rid]] * 5
    assert groups == sorted(groups, key=groups.index)  # contiguous


def test_cache_aware_dedups_an_uncached_shared_prefix(kv):
    rng = random.Random(2)
    reqs, group, systems = gsp_queue(rng, num_groups=3, per_group=4)
    pol = SchedulePolicy("cache-aware", kv)
    out = pol.order(reqs, 0)
    assert sorted(group[r.rid] for r in out) == [0, 1, 2]  # one leader per group
    # Once a group's system prompt is cached, all its members go, and first.
    cache(kv, systems[1])
    out = pol.order(reqs, 1)
    members = [r for r in reqs if group[r.rid] == 1]
    assert out[:4] == sorted(members, key=lambda r: r.arrival_time)  # all of them, in arrival order
    assert sorted(group[r.rid] for r in out[4:]) == [0, 2]


def test_cache_aware_defers_requests_sharing_a_running_prefill(kv):
    rng = random.Random(3)
    reqs, group, _ = gsp_queue(rng, num_groups=2, per_group=3)
    leader = reqs[0]
    leader.kv_len = 16  # running, prompt half computed
    waiting = reqs[1:]
    out = SchedulePolicy("cache-aware", kv).order(waiting, 0, running=[leader])
    assert all(group[r.rid] != group[leader.rid] for r in out)
    assert len(out) == 1  # the other group's leader only


def test_short_shared_prefix_is_not_deduped(kv):
    reqs = [make_req([5] * 8 + [i] * 40) for i in range(10, 14)]  # share 8 tokens < dedup_min_tokens
    out = SchedulePolicy("cache-aware", kv, PolicyConfig(block_size=4, dedup_min_tokens=32)).order(reqs, 0)
    assert out == reqs


def test_salts_never_group(kv):
    prompt = list(range(200, 264))
    reqs = [make_req(prompt, salt="a"), make_req(prompt, salt="b")]
    out = SchedulePolicy("cache-aware", kv).order(reqs, 0)
    assert out == reqs  # no dedup across tenants


def _miss_admitted_at(kv, pol):
    """The step at which a request that misses the cache goes first, behind 5 older ones and a stream of hits."""
    hot = list(range(300, 364))
    cache(kv, hot)
    waiting = [make_req(hot + [900 + i], step=0) for i in range(5)]
    miss = make_req(list(range(1000, 1064)), step=1)
    waiting.append(miss)
    for step in range(1, 40):
        waiting.append(make_req(hot + [step], step=step))
        out = pol.order(waiting, step)
        if out[0] is miss:
            return step
        admit(waiting, out[0])
    return None


def test_overtake_rule_promotes_a_starving_request(kv):
    pol = SchedulePolicy("cache-aware", kv, PolicyConfig(overtake_ratio=1.0))
    # Steps 1-5 admit the 5 requests that were ahead (fcfs would admit the miss at step 6), step 6
    # the hot request that arrived with it (a peer, not an overtake), steps 7-11 five later
    # arrivals overtaking it; then it goes first.
    assert _miss_admitted_at(kv, pol) == 12
    assert pol.num_urgent >= 1


@pytest.mark.parametrize("pressed, agent_cache, expected", [(False, True, 12), (True, True, 8), (True, False, 12)])
def test_under_memory_pressure_a_request_overtaken_once_goes_first(pressed, agent_cache, expected):
    kv = PrefixKV(50_000, 1, False, "lru-reuse", agent_cache=agent_cache)
    if pressed:
        kv.sessions.note_eviction()  # an admission just evicted cached paths
    planner_view = agent_cache and kv.sessions.under_pressure()  # what the planner sets each step
    pol = SchedulePolicy("cache-aware", kv, PolicyConfig(overtake_ratio=1.0))
    pol.pressed = planner_view
    # Unpressed: as in test_overtake_rule_promotes_a_starving_request (five overtakes, then first). Pressed: steps
    # 1-5 the older ones, 6 its same-step peer, 7 one later arrival overtakes it, step 8 it goes first.
    assert _miss_admitted_at(kv, pol) == expected


def test_without_a_starvation_rule_the_miss_waits_for_the_stream(kv):
    hot = list(range(300, 364))
    cache(kv, hot)
    pol = SchedulePolicy("cache-aware", kv, PolicyConfig(starvation_rule="none"))
    miss = make_req(list(range(1000, 1064)), step=0)
    waiting = [miss]
    for step in range(1, 40):
        waiting.append(make_req(hot + [step], step=step))
        out = pol.order(waiting, step)
        assert out[0] is not miss
        admit(waiting, out[0])


def test_batch_arrivals_never_trigger_the_overtake_rule(kv):
    rng = random.Random(4)
    reqs, _, _ = gsp_queue(rng, num_groups=4, per_group=8)
    pol = SchedulePolicy("cache-aware", kv, PolicyConfig(overtake_ratio=0.0, dedup_min_tokens=10**6))
    waiting = list(reqs)
    for step in range(len(reqs)):
        out = pol.order(waiting, step)
        admit(waiting, out[0])  # the policy reorders freely: same-step arrivals never overtake
    assert pol.num_urgent == 0


def test_aging_rule_promotes_after_max_wait_steps(kv):
    cfg = PolicyConfig(starvation_rule="aging", max_wait_steps=3)
    pol = SchedulePolicy("cache-aware", kv, cfg)
    hot = list(range(300, 364))
    cache(kv, hot)
    old = make_req(list(range(1000, 1040)), step=0)
    new = make_req(hot + [1], step=2)
    assert pol.order([old, new], 2)[0] is new
    assert pol.order([old, new], 3)[0] is old


def test_ordering_cost_is_bounded_by_the_window(kv, monkeypatch):
    rng = random.Random(5)
    prefix = [rng.randrange(10, 4000) for _ in range(512)]
    cache(kv, prefix)
    reqs = [make_req(prefix + [rng.randrange(10, 4000) for _ in range(64)]) for _ in range(3000)]
    calls = []
    real_peek = kv.tree.peek_prefix
    monkeypatch.setattr(kv.tree, "peek_prefix", lambda *a, **k: calls.append(1) or real_peek(*a, **k))
    pol = SchedulePolicy("cache-aware", kv, PolicyConfig(window=128))
    out = pol.order(reqs, 0)
    assert len(out) == 3000
    assert len(calls) <= 128


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="starvation_rule"):
        PolicyConfig(starvation_rule="lottery")
    with pytest.raises(ValueError, match="window"):
        PolicyConfig(window=0)
    with pytest.raises(ValueError, match="schedule_policy"):
        SchedulePolicy("random", PrefixKV(16, 1, False, "lru"))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=12))
def test_tree_walk_keeps_every_shared_prefix_contiguous(prompts):
    block = 2
    keys = [block_key(p, None, block) for p in prompts]
    groups = PrefixGroups(keys, [len(p) for p in prompts], [], [], block_size=block)
    order = groups.dfs_order(cached=None, dedup_min_tokens=None)
    assert sorted(order) == list(range(len(prompts)))
    walked = [keys[i] for i in order]
    # Every key prefix (a subtree of the trie of blocks) occupies one contiguous run of the walk.
    for depth in range(1, max(len(k) for k in keys) + 1):
        seen_done: set = set()
        current = None
        for key in walked:
            if len(key) < depth:
                continue
            head = key[:depth]
            if head != current:
                assert head not in seen_done, f"prefix {head} split in {walked}"
                if current is not None:
                    seen_done.add(current)
                current = head


def test_per_request_state_stays_bounded_over_a_long_stream(kv):
    pol = SchedulePolicy("cache-aware", kv)
    prefix = list(range(400, 464))
    cache(kv, prefix)
    waiting = []
    for step in range(1500):
        waiting.append(make_req(prefix + [step % 3000 + 10, step // 3000 + 10], step=step))
        if step % 5 == 4:  # a client gives up: aborted while waiting
            gone = waiting.pop(0)
            gone.status = ReqStatus.FINISHED
        out = pol.order(waiting, step)
        if out:
            admit(waiting, out[0])
            out[0].kv_len = len(out[0].prompt_ids)  # prefill done: no longer a dedup claim
    assert len(waiting) < 5
    assert len(pol._ahead) <= 2 * len(waiting) + 256
    assert len(pol._keys) <= 2 * len(waiting) + 256
