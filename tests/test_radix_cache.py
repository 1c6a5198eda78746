import pytest

from radixserve.radix import KVAllocator, RadixCache


def make_cache(num_slots=64, page_size=1, **kwargs):
    return RadixCache(KVAllocator(num_slots, page_size), page_size=page_size, **kwargs)


def put(cache, tokens, salt=None):
    """Cache `tokens` as a finished request would: match, allocate the rest, insert, free duplicates."""
    cached_slots, _ = cache.match_prefix(tokens, salt)
    own_slots = cache.allocator.alloc(len(tokens) - len(cached_slots))
    assert own_slots is not None, "test pool too small"
    slot_ids = cached_slots + own_slots
    num_already = cache.insert(tokens, slot_ids, salt)
    cache.allocator.free(slot_ids[len(cached_slots):num_already])
    cache.check_integrity()
    return slot_ids


def test_match_splits_edge_and_returns_the_split_node():
    cache = make_cache()
    slot_ids = put(cache, [1, 2, 3, 4, 5])
    matched, node = cache.match_prefix([1, 2, 3, 9])
    assert matched == slot_ids[:3]
    assert node.key == (1, 2, 3) and len(node.children) == 1
    (lower,) = node.children.values()
    assert lower.key == (4, 5) and lower.value == slot_ids[3:]
    cache.check_integrity()
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0] == slot_ids
    assert cache.match_prefix([2, 3])[0] == []


def test_insert_returns_already_cached_count():
    cache = make_cache()
    put(cache, [1, 2, 3, 4])
    cached = cache.allocator.num_used_slots
    assert cache.insert([1, 2, 3, 4], cache.match_prefix([1, 2, 3, 4])[0]) == 4
    slot_ids = cache.allocator.alloc(6)
    assert cache.insert([1, 2, 7, 8, 9, 10], slot_ids) == 2
    cache.allocator.free(slot_ids[:2])
    assert cache.total_size == cached + 4
    assert cache.match_prefix([1, 2, 7, 8, 9, 10])[0][2:] == slot_ids[2:]
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_insert_path_returns_the_match_the_caller_would_walk_again_for(page_size):
    cache = make_cache(page_size=page_size)
    first = put(cache, [1, 2, 3, 4, 5, 6])
    own = cache.allocator.alloc(8)
    tokens = [1, 2, 3, 4, 7, 8, 9, 10]
    num_cached, cached, node = cache.insert_path(tokens, own)
    assert num_cached == 4 and cached == first[:4]  # the tree's slots of the part it had
    cache.allocator.free(own[:4])
    # The node ends the inserted path: what match_prefix would return, without a second walk.
    assert cache.match_prefix(tokens, record_hit=False) == (first[:4] + own[4:], node)
    again = cache.insert_path(tokens, first[:4] + own[4:])
    assert again == (8, first[:4] + own[4:], node)  # all cached: the same node, nothing added
    cache.lock(node)
    assert cache.evict(100) == 2 and cache.locked_size == 8  # the locked path survives
    cache.unlock(node)
    num, slots, root = cache.insert_path([], [])
    assert (num, slots) == (0, []) and root.is_root
    cache.check_integrity()


def test_split_keeps_locks_of_the_lower_node():
    cache = make_cache()
    put(cache, [1, 2, 3, 4, 5])
    _, node = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(node)
    _, upper = cache.match_prefix([1, 2, 9])  # splits the locked edge
    assert upper.lock_ref == 1 and upper.key == (1, 2)
    assert cache.locked_size == 5 and cache.evictable_size == 0
    cache.check_integrity()
    cache.unlock(node)
    assert cache.locked_size == 0 and cache.evictable_size == 5
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [2, 4])
def test_pages_only_whole_pages_match_and_split(page_size):
    cache = make_cache(64, page_size)
    tokens = list(range(100, 100 + 3 * page_size))
    slot_ids = put(cache, tokens)
    assert cache.match_prefix(tokens + [1])[0] == slot_ids
    assert cache.match_prefix(tokens[:-1])[0] == slot_ids[:2 * page_size]
    # A mismatch inside the second page: only the first page matches, and the split is there.
    wrong = tokens[:page_size + 1] + [0] + tokens[page_size + 2:]
    matched, node = cache.match_prefix(wrong)
    assert matched == slot_ids[:page_size] and len(node.key) == page_size
    cache.check_integrity()
    new_slots = cache.allocator.alloc(len(wrong) - page_size)
    assert cache.insert(wrong, matched + new_slots) == page_size
    assert cache.match_prefix(wrong)[0] == matched + new_slots
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_repeated_prompt_matches_capped_whole_pages(page_size):
    for prompt_len in range(1, 21):
        cache = make_cache(64, page_size)
        prompt = [7 + (i * 5) % 11 for i in range(prompt_len)]
        num_whole = prompt_len - prompt_len % page_size
        put(cache, prompt[:num_whole])  # a finished request caches only its whole pages
        matched, _ = cache.match_prefix(prompt[:prompt_len - 1])  # the caller caps at L - 1
        assert len(matched) == ((prompt_len - 1) // page_size) * page_size


def test_pages_refuse_partial_or_misaligned_inserts():
    cache = make_cache(32, 4)
    with pytest.raises(ValueError, match="whole number of pages"):
        cache.insert([1, 2, 3], [0, 1, 2])
    with pytest.raises(ValueError, match="slot ids"):
        cache.insert([1, 2, 3, 4], [0, 1, 2])
    slot_ids = cache.allocator.alloc(8)
    with pytest.raises(ValueError, match="whole page"):
        cache.insert([1, 2, 3, 4], slot_ids[2:6])
    with pytest.raises(ValueError, match="allocator"):
        RadixCache(KVAllocator(32, 4), page_size=1)


def test_salts_isolate_namespaces():
    cache = make_cache()
    tokens = [5, 6, 7, 8]
    slots_a = put(cache, tokens, salt="a")
    assert cache.match_prefix(tokens, salt="b")[0] == []
    assert cache.match_prefix(tokens)[0] == []
    slots_none = put(cache, tokens)
    assert set(slots_none).isdisjoint(slots_a)
    assert cache.match_prefix(tokens, salt="a")[0] == slots_a
    assert cache.match_prefix(tokens)[0] == slots_none
    cache.check_integrity()


def test_lock_prevents_eviction_and_unlock_below_zero_fails():
    cache = make_cache()
    kept = put(cache, [1, 2, 3])
    put(cache, [4, 5, 6, 7])
    _, node = cache.match_prefix([1, 2, 3])
    cache.lock(node)
    assert cache.locked_size == 3 and cache.evictable_size == 4
    assert cache.evict(100) == 4
    assert cache.match_prefix([1, 2, 3])[0] == kept
    assert cache.match_prefix([4, 5])[0] == []
    cache.check_integrity()
    cache.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    assert cache.evict(3) == 3
    assert cache.total_size == 0 and cache.allocator.num_free_slots == 64
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(node)
    cache.check_integrity()


def test_eviction_frees_leaves_before_parents_and_stops_when_enough():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [9, 9])
    cache.match_prefix([1, 2, 3, 4, 5])  # makes [9, 9] the oldest
    assert cache.evict(2) == 2
    assert cache.match_prefix([9, 9])[0] == []
    assert cache.evict(2) == 2  # the [4, 5] leaf, not its parent
    assert len(cache.match_prefix([1, 2, 3, 4, 5])[0]) == 3
    assert cache.evict(0) == 0
    assert cache.num_evicted_tokens == 4
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_eviction_takes_only_the_tail_of_the_last_leaf_it_needs(page_size):
    """A token-level cache keeps the head of a path whose tail it evicts: the head still serves a partial match,
    and a waiting request's hint on the leaf now covers what is left."""
    cache = make_cache(page_size=page_size)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    _, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], record_hit=False)
    cache.hint(node)
    assert cache.evict(3) == (3 if page_size == 1 else 4)  # whole pages
    assert len(cache.peek_prefix([1, 2, 3, 4, 5, 6, 7, 8])) == (5 if page_size == 1 else 4)
    assert cache.evictable_size == cache.total_size == (5 if page_size == 1 else 4)
    cache.unhint(node)  # the hint moved to the head that stayed
    cache.check_integrity()
    assert cache.evict(100) == (5 if page_size == 1 else 4) and cache.total_size == 0
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "lru-reuse"])
def test_hot_prefix_survives_one_off_stream_only_with_reuse(policy):
    cache = make_cache(48, eviction_policy=policy)
    hot = [1000 + i for i in range(8)]
    put(cache, hot)
    for _ in range(15):  # 15 hits: log2(16) = 4 doublings of reuse bonus
        assert len(cache.match_prefix(hot)[0]) == 8
    for request_idx in range(20):
        one_off = [request_idx * 100 + i for i in range(8)]
        if cache.allocator.num_free_slots < 8:
            cache.evict(8 - cache.allocator.num_free_slots)
        put(cache, one_off)
    hot_survived = len(cache.peek_prefix(hot)) == 8
    assert hot_survived == (policy == "lru-reuse")
    assert cache.num_evicted_tokens >= 8 * 14


def test_lru_reuse_bonus_is_configurable():
    with pytest.raises(ValueError):
        make_cache(reuse_bonus=-1.0)
    with pytest.raises(ValueError, match="eviction_policy"):
        make_cache(eviction_policy="lfu")
    cache = make_cache(16, reuse_bonus=0.0)  # no bonus: plain LRU order
    put(cache, [1, 2])
    for _ in range(5):
        cache.match_prefix([1, 2])
    put(cache, [3, 4])
    assert cache.evict(2) == 2
    assert cache.peek_prefix([1, 2]) == [] and len(cache.peek_prefix([3, 4])) == 2


def test_peek_prefix_is_read_only():
    cache = make_cache()
    slot_ids = put(cache, [1, 2, 3, 4])
    put(cache, [8, 8])
    assert cache.peek_prefix([1, 2, 9]) == slot_ids[:2]
    assert cache.peek_prefix([1, 2, 3, 4], salt="x") == []
    (node,) = [n for n in cache._roots[None].children.values() if n.key[0] == 1]
    assert node.key == (1, 2, 3, 4) and node.hit_count == 0  # not split, not stamped
    assert cache.evict(4) == 4  # still the oldest


def test_disable_caches_nothing():
    cache = make_cache(16, disable=True)
    slot_ids = cache.allocator.alloc(4)
    assert cache.insert([1, 2, 3, 4], slot_ids) == 0
    matched, node = cache.match_prefix([1, 2, 3, 4])
    assert matched == [] and node.is_root
    cache.lock(node)
    cache.unlock(node)
    assert cache.total_size == 0
    cache.check_integrity(in_flight_slots=slot_ids)


def test_reset_frees_all_and_refuses_while_locked():
    cache = make_cache(32, 4)
    put(cache, list(range(8)), salt="s")
    put(cache, list(range(12)))
    _, node = cache.match_prefix(list(range(8)))
    cache.lock(node)
    with pytest.raises(ValueError, match="locked"):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.total_size == 0 and cache.allocator.num_free_slots == 32
    assert cache.all_slot_ids() == [] and cache.match_prefix(list(range(8)))[0] == []
    cache.check_integrity()


def test_empty_namespace_is_dropped_after_eviction():
    cache = make_cache()
    put(cache, [1, 2], salt="tenant")
    assert "tenant" in cache._roots
    cache.evict(2)
    assert "tenant" not in cache._roots
    cache.check_integrity()


def test_check_integrity_catches_broken_accounting():
    cache = make_cache(16)
    put(cache, [1, 2, 3])
    in_flight = cache.allocator.alloc(2)
    cache.check_integrity(in_flight_slots=2)
    cache.check_integrity(in_flight_slots=in_flight)
    with pytest.raises(AssertionError, match="accounting"):
        cache.check_integrity()
    with pytest.raises(AssertionError, match="also in the tree"):
        cache.check_integrity(in_flight_slots=[in_flight[0], cache.all_slot_ids()[0]])
    cache.allocator.free(cache.all_slot_ids())  # the tree's slots freed behind its back
    with pytest.raises(AssertionError, match="free"):
        cache.check_integrity(in_flight_slots=2)


def test_match_without_recording_a_hit_leaves_eviction_order_alone():
    alloc = KVAllocator(64)
    cache = RadixCache(alloc, eviction_policy="lru-reuse")
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    cache.insert([7, 8, 9], alloc.alloc(3))
    before = {n.node_id: (n.hit_count, n.last_access) for n in cache._iter_nodes()}
    slots, node = cache.match_prefix([1, 2, 3, 9], record_hit=False)  # splits, but records nothing
    assert len(slots) == 3 and node.hit_count == before.get(node.node_id, (0, 0))[0]
    cache.evict(4)  # [7, 8, 9] was inserted last, so the older [1, 2, 3, 4] goes first
    assert cache.peek_prefix([1, 2, 3]) == [] and len(cache.peek_prefix([7, 8, 9])) == 3
