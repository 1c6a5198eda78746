"""``shared_prefixes`` / ``order_by_prefix`` over a real RadixCache + KVAllocator.

Prompts are cached, then each request of a batch matches its tokens and locks its node, as the
engine does. The ranges are judged against an oracle that never looks at the tree: slots of the
tree are unique, so requests i and k share position j exactly when slots_i[j] == slots_k[j].
Per request, the positions with the same set of sharers (>= 2) form one run (a chain of nodes
with the same requests below is one range); walking the runs from the root, a run ending less
than min_tokens after the last used range is skipped (its keys fold into the next used range).
"""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.attention.metadata import meta_from_slot_lists
from radixserve.radix import KVAllocator, RadixCache
from radixserve.scheduler.shared_prefix import order_and_share, order_by_prefix, shared_prefixes


def cache_prompts(prompts, page_size=1, salts=None, num_slots=None):
    """A cache holding every prompt's whole pages (salts[i]: prompt i's namespace)."""
    total = sum(len(p) for p in prompts)
    num_slots = num_slots or (total // page_size + 4) * page_size
    allocator = KVAllocator(num_slots, page_size=page_size)
    cache = RadixCache(allocator, page_size=page_size)
    for i, tokens in enumerate(prompts):
        tokens = tokens[:len(tokens) - len(tokens) % page_size]
        slots = allocator.alloc(len(tokens))
        num_cached = cache.insert(tokens, slots, salt=salts[i] if salts else None)
        allocator.free(slots[:num_cached])  # the tree keeps its own slots for the cached part
    cache.check_integrity()
    return cache


def lock_requests(cache, requests, salts=None):
    """(nodes, slot lists) of each request's cached prefix, its node locked."""
    nodes, slot_lists = [], []
    for i, tokens in enumerate(requests):
        slots, node = cache.match_prefix(tokens, salt=salts[i] if salts else None)
        cache.lock(node)
        nodes.append(node)
        slot_lists.append(slots)
    return nodes, slot_lists


def oracle(slot_lists, min_tokens):
    """The expected ranges as {(kv_start, kv_end, members)}, from the slots alone."""
    expected = set()
    for i, slots in enumerate(slot_lists):
        runs = []  # [start, end, sharers]
        for j, slot in enumerate(slots):
            sharers = tuple(k for k, other in enumerate(slot_lists) if len(other) > j and other[j] == slot)
            if len(sharers) < 2:
                break
            if runs and runs[-1][2] == sharers:
                runs[-1][1] = j + 1
            else:
                runs.append([j, j + 1, sharers])
        covered = 0
        for _, end, sharers in runs:
            if end - covered >= max(min_tokens, 1):
                expected.add((covered, end, sharers))
                covered = end
    return expected


def as_set(ranges):
    return {(p.kv_start, p.kv_end, tuple(p.seq_idx)) for p in ranges}


def own_starts(ranges, num):
    """Per request, the end of its shared ranges; asserts they tile [0, own_start)."""
    own = [0] * num
    for p in sorted(ranges, key=lambda p: p.kv_start):
        for i in p.seq_idx:
            assert own[i] == p.kv_start, f"request {i}: gap or overlap before {p}"
            own[i] = p.kv_end
    return own


def check_forest(nodes, slot_lists, min_tokens):
    """Every property of the ranges of one batch; returns them."""
    ranges = shared_prefixes(nodes, min_tokens)
    assert len(as_set(ranges)) == len(ranges), "a range listed twice"
    for p in ranges:
        assert len(p.seq_idx) >= 2 and len(set(p.seq_idx)) == len(p.seq_idx), p
        assert p.seq_idx == sorted(p.seq_idx) and p.kv_start < p.kv_end, p
        first = slot_lists[p.seq_idx[0]][p.kv_start:p.kv_end]
        for i in p.seq_idx:
            assert len(slot_lists[i]) >= p.kv_end, f"{p} lies past request {i}'s cached prefix"
            assert slot_lists[i][p.kv_start:p.kv_end] == first, f"{p}: request {i} holds other slots"
    own = own_starts(ranges, len(nodes))
    assert all(o <= len(s) for o, s in zip(own, slot_lists))
    # Chains of nodes with the same requests below are one range: two ranges back to back never
    # have the same members.
    ends = {(p.kv_end, tuple(p.seq_idx)) for p in ranges}
    assert not [p for p in ranges if (p.kv_start, tuple(p.seq_idx)) in ends], "a chain split in two"
    assert as_set(ranges) == oracle(slot_lists, min_tokens)
    # The runner accepts them: one new token per request after its cached prefix.
    meta_from_slot_lists([len(s) for s in slot_lists], [1] * len(nodes),
                         [s + [10**6 + i] for i, s in enumerate(slot_lists)], "cpu", shared=ranges,
                         needs_kv_indices=False)
    # order_by_prefix: a permutation after which every range's members are adjacent.
    order = order_by_prefix(nodes)
    assert sorted(order) == list(range(len(nodes)))
    reordered = shared_prefixes([nodes[i] for i in order], min_tokens)
    for p in reordered:
        assert p.seq_idx == list(range(p.seq_idx[0], p.seq_idx[0] + len(p.seq_idx))), f"{p} not adjacent"
    assert {(a, b, tuple(sorted(order[i] for i in m))) for a, b, m in as_set(reordered)} == as_set(ranges)
    assert order_and_share(nodes, min_tokens) == (order, reordered)  # the engine's one-walk form
    return ranges


def tok(rng, n):
    return [rng.randrange(1, 50_000) for _ in range(n)]


# -- a hand-built forest ------------------------------------------------------------------------

def _family(page_size=1):
    """System prompt S shared by all, few-shot F by requests 0-2, own suffixes; request 7 repeats
    request 3's prompt; 5 has nothing cached, 6 no node at all. A cached prompt outside the
    batch splits S at 20 tokens, so S is a chain of two nodes with the same requests below."""
    rng = random.Random(0)
    S, F = tok(rng, 50), tok(rng, 30)
    suffix = [tok(rng, n) for n in (7, 9, 11, 13, 5)]
    prompts = [S + F + suffix[0], S + F + suffix[1], S + F + suffix[2], S + suffix[3], S + suffix[4],
               S[:20] + tok(rng, 12)]
    requests = [S + F + suffix[0] + tok(rng, 3), S + F + suffix[1], S + F + suffix[2] + tok(rng, 40),
                S + suffix[3] + tok(rng, 2), S + suffix[4], tok(rng, 30), None, S + suffix[3]]
    cache = cache_prompts(prompts, page_size)
    nodes, slot_lists = lock_requests(cache, [r or [] for r in requests])
    nodes[6] = None
    return cache, nodes, slot_lists


def test_forest_ranges_and_min_tokens():
    cache, nodes, slots = _family()
    assert [len(n.key) for n in (nodes[3].parent, nodes[3].parent.parent)] == [30, 20], "S is a chain"
    assert nodes[5].is_root and slots[5] == [] and slots[6] == []
    full = check_forest(nodes, slots, min_tokens=0)
    assert as_set(full) == {(0, 50, (0, 1, 2, 3, 4, 7)), (50, 80, (0, 1, 2)), (50, 63, (3, 7))}
    assert own_starts(full, 8) == [80, 80, 80, 63, 50, 0, 0, 63]
    assert as_set(check_forest(nodes, slots, 1)) == as_set(full)
    # min 20: the suffix of requests 3 and 7 (13) is too short, and nothing shared lies below it.
    assert as_set(check_forest(nodes, slots, 20)) == {(0, 50, (0, 1, 2, 3, 4, 7)), (50, 80, (0, 1, 2))}
    # min 40: F (30) alone is too short.
    assert as_set(check_forest(nodes, slots, 40)) == {(0, 50, (0, 1, 2, 3, 4, 7))}
    # min 60: S (50) is too short, so the ranges below it start at 0 (S folded into them).
    ranges = check_forest(nodes, slots, 60)
    assert as_set(ranges) == {(0, 80, (0, 1, 2)), (0, 63, (3, 7))}
    assert own_starts(ranges, 8) == [80, 80, 80, 63, 0, 0, 0, 63]
    assert as_set(check_forest(nodes, slots, 70)) == {(0, 80, (0, 1, 2))}
    assert check_forest(nodes, slots, 1000) == []
    for node in nodes:
        if node is not None:
            cache.unlock(node)
    cache.check_integrity()


def test_forest_order_by_prefix_groups_members():
    nodes = _family()[1]
    order = order_by_prefix(nodes)
    assert order.index(5) < order.index(0) and order.index(6) < order.index(0)  # no prefix: first
    pos = sorted(order.index(i) for i in (0, 1, 2))
    assert pos == list(range(pos[0], pos[0] + 3))
    assert abs(order.index(3) - order.index(7)) == 1


@pytest.mark.parametrize("page_size", [4, 16])
def test_forest_with_pages(page_size):
    cache, nodes, slots = _family(page_size)
    assert all(len(s) % page_size == 0 for s in slots)
    for min_tokens in (0, 16, 40, 64):
        ranges = check_forest(nodes, slots, min_tokens)
        assert all(p.kv_start % page_size == 0 and p.kv_end % page_size == 0 for p in ranges)
    if page_size == 16:
        # Whole pages only: S (50) -> 48 shared by all (split at 16 by the prompt outside the
        # batch: one range); S + F -> 80 for 0-2; S + suffix (63) -> 48, so 3, 4, 7 stop there.
        assert as_set(shared_prefixes(nodes, 0)) == {(0, 48, (0, 1, 2, 3, 4, 7)), (48, 80, (0, 1, 2))}
    for node in nodes:
        if node is not None:
            cache.unlock(node)
    cache.check_integrity()


def test_requests_without_cached_prefix_share_nothing():
    cache = cache_prompts([[1, 2, 3]])
    nodes, slots = lock_requests(cache, [[9, 9], [8], [1, 2, 3, 4]])
    assert check_forest(nodes + [None], slots + [[]], 0) == []
    # Two requests on the same node share its whole path.
    nodes2, slots2 = lock_requests(cache, [[1, 2, 3, 4], [1, 2, 3, 5], [7]])
    assert as_set(check_forest(nodes2, slots2, 0)) == {(0, 3, (0, 1))}


def test_salts_never_share():
    tokens = list(range(100, 140))
    cache = cache_prompts([tokens, tokens], salts=[None, "b"])
    nodes, slots = lock_requests(cache, [tokens, tokens, tokens], salts=[None, "b", None])
    assert as_set(check_forest(nodes, slots, 0)) == {(0, 40, (0, 2))}


# -- random prompt families ---------------------------------------------------------------------

@st.composite
def families(draw):
    """A tree of token blocks (prompts = root-to-node concatenations), which prompts are cached,
    and a batch of requests, each a cut of some prompt plus fresh tokens (or no prompt at all)."""
    page_size = draw(st.sampled_from([1, 1, 4, 16]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    blocks = [([], None)]  # (tokens of the prompt ending here, parent index)
    for _ in range(draw(st.integers(1, 8))):
        parent = draw(st.integers(0, len(blocks) - 1))
        length = draw(st.one_of(st.integers(1, 8), st.integers(9, 70)))
        blocks.append((blocks[parent][0] + tok(rng, length), parent))
    prompts = [b[0] for b in blocks[1:]]
    cached = [p for p in prompts if draw(st.integers(0, 3))] or prompts[:1]
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        if draw(st.integers(0, 9)) == 0:
            requests.append(tok(rng, 5))  # no cached prefix
            continue
        base = draw(st.sampled_from(prompts))
        cut = len(base) if draw(st.booleans()) else draw(st.integers(0, len(base)))
        requests.append(base[:cut] + tok(rng, draw(st.integers(0, 5))))
    salts = [draw(st.sampled_from([None] * 5 + ["s"])) for _ in range(len(cached) + len(requests))]
    return page_size, cached, requests, salts[:len(cached)], salts[len(cached):]


@settings(max_examples=300, deadline=None)
@given(family=families(), min_tokens=st.sampled_from([0, 1, 5, 16, 40]))
def test_random_families(family, min_tokens):
    page_size, cached, requests, cache_salts, req_salts = family
    cache = cache_prompts(cached, page_size, cache_salts)
    nodes, slots = lock_requests(cache, requests, req_salts)
    cache.check_integrity()
    check_forest(nodes, slots, min_tokens)
    for node in nodes:
        cache.unlock(node)
    cache.check_integrity()
