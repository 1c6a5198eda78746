"""Stateful property test: random request lifecycles against RadixCache vs an independent model.

The model is a dict {(salt, prefix tokens): slot ids of the prefix's last page} holding every cached
whole-page prefix. It learns insertions from what the test inserted and evictions from what the
allocator reports freed, and checks the cache against both after every step.
"""

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from radixserve.radix import KVAllocator, RadixCache, TreeNode

SALTS = [None, "a", "b"]
salts = st.sampled_from([None, None, None, "a", "b"])  # mostly one namespace, so prefixes get reused
LOCKED_EVICTION = "evict with locked nodes present"
MAX_RUNNING = 3
STATE_MACHINE_SETTINGS = settings(max_examples=200, stateful_step_count=30, deadline=None)


@dataclass
class Req:
    salt: str | None
    tokens: list[int]
    slot_ids: list[int]  # [cached from tree | own, in flight]; own part padded to whole pages
    num_cached: int  # leading slot ids that belong to the tree (locked through `node`)
    node: TreeNode


def make_machine(page_size: int, num_slots: int, stats: Counter) -> type:
    # Shared-prefix bases over a tiny alphabet so requests overlap, diverge mid-page and split edges.
    base_len = max(8, 6 * page_size)
    shared = [(i * 7) % 4 for i in range(base_len)]
    bases = [shared, shared[:base_len // 2] + [3] * (base_len // 2), [(i * 5 + 2) % 4 for i in range(base_len)]]
    prompts = st.builds(
        lambda base_idx, keep, tail: (bases[base_idx][:keep] + tail) or [0],
        st.integers(0, len(bases) - 1),
        st.integers(0, base_len),
        st.lists(st.integers(0, 2), max_size=2 * page_size),
    )

    def note(what: str) -> None:
        stats[what] += 1
        event(what)  # shown by pytest --hypothesis-show-statistics

    class RadixMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.allocator = KVAllocator(num_slots, page_size)
            self.model: dict[tuple, tuple[int, ...]] = {}
            self.requests: list[Req] = []
            self.pins: list[tuple[str | None, list[int], TreeNode]] = []  # (salt, pinned prefix, node)
            self.hints: list[tuple[str | None, list[int], TreeNode]] = []  # (salt, prompt, node): waiting requests
            self.cache: RadixCache | None = None
            self.cursors: dict[tuple, object] = {}  # (salt, probe tokens) -> its last match cursor

        @initialize(policy=st.sampled_from(["lru", "lru-reuse"]), reuse_bonus=st.sampled_from([0.0, 4.0, 64.0]))
        def make_cache(self, policy: str, reuse_bonus: float) -> None:
            self.cache = RadixCache(self.allocator, page_size, eviction_policy=policy, reuse_bonus=reuse_bonus)

        # -------------------------------------------------------------- rules

        @rule(tokens=prompts, salt=salts, cap=st.booleans())
        def start_request(self, tokens, salt, cap):
            if len(self.requests) >= MAX_RUNNING:  # no room for another: the oldest finishes first
                self.finish(self.requests.pop(0))
            query = tokens[:-1] if cap else tokens  # the scheduler caps at L - 1
            expected = self.model_match(query, salt)
            matched, node = self.cache.match_prefix(query, salt)
            assert matched == expected, f"match {matched} != longest cached prefix {expected}"
            if matched:
                note("cache hit")
            self.cache.lock(node)
            num_own = _round_up(len(tokens) - len(matched), page_size)
            own = self.allocator.alloc(num_own)
            if own is None:  # the request's own match is locked already: it is not evictable
                self.evict_and_sync(num_own - self.allocator.num_free_slots, pending=(salt, query[:len(matched)]))
                own = self.allocator.alloc(num_own)
            if own is None:
                assert self.allocator.num_free_slots + self.cache.evictable_size < num_own
                self.cache.unlock(node)
                note("request refused: pool full of locked prefixes")
                return
            self.requests.append(Req(salt, list(tokens), matched + own, len(matched), node))

        # One rule for all request progress (fewer rules gated by preconditions means fewer
        # examples that hypothesis abandons while looking for an enabled rule).
        @precondition(lambda self: self.requests)
        @rule(data=st.data(), action=st.sampled_from(["finish", "finish", "pin", "checkpoint", "abort"]))
        def progress_request(self, data, action):
            req_idx = data.draw(st.integers(0, len(self.requests) - 1), label="req_idx")
            req = self.requests[req_idx]
            if action == "checkpoint" and len(req.tokens) - req.num_cached >= page_size:
                max_pages = (len(req.tokens) - req.num_cached) // page_size
                self.checkpoint(req, req.num_cached + page_size * data.draw(st.integers(1, max_pages)))
                return
            del self.requests[req_idx]
            if action == "abort":  # drop the in-flight slots, keep the tree as it was
                self.allocator.free(req.slot_ids[req.num_cached:])
                self.cache.unlock(req.node)
                return
            self.finish(req, pin=action == "pin")

        @rule(tokens=prompts, salt=salts, drop=st.booleans(), data=st.data())
        def wait_or_leave(self, tokens, salt, drop, data):
            """A request waits (its cached prefix hinted: expected to be used) or a waiting one leaves (unhint)."""
            if drop and self.hints:
                _, _, node = self.hints.pop(data.draw(st.integers(0, len(self.hints) - 1), label="hint_idx"))
                self.cache.unhint(node)
                return
            matched, node = self.cache.match_prefix(tokens, salt, record_hit=False)
            if not node.is_root:
                self.cache.hint(node)
                # the path matched now: a hint is a snapshot (the engine hints once per stay in the queue), so a
                # page cached later along the prompt is not hinted
                self.hints.append((salt, list(tokens[:len(matched)]), node))
                note("prefix hinted")

        @precondition(lambda self: self.model)
        @rule(data=st.data(), rank=st.integers(0, 3))
        def demote(self, data, rank):
            """A path goes to the front of the eviction order (a closed session's, or one expected back last)."""
            salt, prefix = data.draw(st.sampled_from(sorted(self.model, key=repr)), label="demoted")
            _, node = self.cache.match_prefix(list(prefix), salt, record_hit=False)
            if self.cache.demote(node, rank):
                note("path demoted")

        @precondition(lambda self: self.pins)
        @rule(data=st.data())
        def unpin(self, data):
            _, _, node = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1), label="pin_idx"))
            self.cache.unlock(node, pin=True)

        # Flush is folded into this rule (1 draw in 10) so it stays rare without a precondition.
        @rule(num_tokens=st.integers(0, num_slots), flush=st.sampled_from([False] * 9 + [True]))
        def evict(self, num_tokens, flush):
            if not flush:
                self.evict_and_sync(num_tokens)
            elif self.cache.locked_size:
                free_before = self.allocator.num_free_slots
                with pytest.raises(ValueError, match="locked"):
                    self.cache.reset()
                assert self.allocator.num_free_slots == free_before
            else:
                self.cache.reset()
                self.model.clear()
                in_flight = sum(len(r.slot_ids) - r.num_cached for r in self.requests)
                assert self.allocator.num_free_slots == num_slots - in_flight

        # -------------------------------------------------------------- request steps and model updates

        def finish(self, req: Req, pin: bool = False) -> None:
            """A request ends; with `pin` its cached path stays locked for its session (a pin) until unpinned."""
            num_insert = len(req.tokens) - len(req.tokens) % page_size  # partial last page is freed
            self.insert_and_sync(req, num_insert)
            self.allocator.free(req.slot_ids[num_insert:])
            if pin and num_insert:
                _, node = self.cache.match_prefix(req.tokens[:num_insert], req.salt, record_hit=False)
                self.cache.lock(node, pin=True)
                self.pins.append((req.salt, req.tokens[:num_insert], node))
                note("path pinned")
            self.cache.unlock(req.node)

        def checkpoint(self, req: Req, num_insert: int) -> None:
            """Chunked prefill: cache a computed chunk, then hold the tree's copy of it instead."""
            self.insert_and_sync(req, num_insert)
            matched, node = self.cache.match_prefix(req.tokens[:num_insert], req.salt)
            assert matched == self.model_match(req.tokens[:num_insert], req.salt)
            assert len(matched) == num_insert
            self.cache.lock(node)
            self.cache.unlock(req.node)
            req.slot_ids[:num_insert] = matched
            req.num_cached = num_insert
            req.node = node

        def insert_and_sync(self, req: Req, num_insert: int) -> None:
            tokens = req.tokens[:num_insert]
            expected_cached = len(self.model_match(tokens, req.salt))
            num_already = self.cache.insert(tokens, req.slot_ids[:num_insert], req.salt)
            assert num_already == expected_cached, f"insert said {num_already} cached, model {expected_cached}"
            assert num_already >= req.num_cached, "the request's locked prefix vanished"
            if num_already > req.num_cached:
                note("insert found a longer cached prefix than the request matched")
            # Our own slots that duplicate what someone else cached meanwhile go back to the pool.
            self.allocator.free(req.slot_ids[req.num_cached:num_already])
            for end in range(num_already + page_size, num_insert + 1, page_size):
                self.model[(req.salt, tuple(tokens[:end]))] = tuple(req.slot_ids[end - page_size:end])
            tree_slots = self.model_match(tokens, req.salt)
            req.slot_ids[req.num_cached:num_already] = tree_slots[req.num_cached:num_already]

        def evict_and_sync(self, num_tokens: int, pending: tuple | None = None) -> None:
            """`pending`: (salt, tokens) of a match locked by a request not yet in self.requests."""
            evictable_before = self.cache.evictable_size
            if self.cache.locked_size and num_tokens and evictable_before:
                note(LOCKED_EVICTION)
            hinted = self.hinted_keys()
            locked = self.locked_keys()
            if pending is not None:
                locked |= {(pending[0], tuple(pending[1][:end])) for end in range(page_size, len(pending[1]) + 1,
                                                                                   page_size)}
            unhinted = sum(1 for key in self.model if key not in hinted and key not in locked) * page_size
            num_freed = self.cache.evict(num_tokens)
            assert min(num_tokens, evictable_before) <= num_freed <= evictable_before
            gone = [key for key, slots in self.model.items() if self.allocator.is_free(slots[0])]
            # Hints are a preference: a hinted page goes only once every unhinted evictable page has gone.
            if any(key in hinted for key in gone):
                note("hinted prefix evicted (nothing else left)")
                assert num_freed >= unhinted, f"a hinted page went while {unhinted} unhinted slots were evictable"
            assert len(gone) * page_size == num_freed, "evict's count disagrees with the allocator"
            for key in gone:
                del self.model[key]
            for salt, prefix in self.model:
                assert len(prefix) == page_size or (salt, prefix[:-page_size]) in self.model, (
                    "eviction left a cached prefix without its parent")

        def hinted_keys(self) -> set:
            """Cached pages of the path a waiting request matched when it was hinted (what it will use if nothing
            evicts it; eviction shortens the path from its end, the hint moving to the parent)."""
            keys = set()
            for salt, tokens, _ in self.hints:
                for end in range(page_size, len(tokens) + 1, page_size):
                    if (salt, tuple(tokens[:end])) not in self.model:
                        break
                    keys.add((salt, tuple(tokens[:end])))
            return keys

        def locked_keys(self) -> set:
            keys = {(r.salt, tuple(r.tokens[:end])) for r in self.requests for end in range(page_size, r.num_cached + 1,
                                                                                          page_size)}
            keys |= {(salt, tuple(tokens[:end])) for salt, tokens, _ in self.pins
                     for end in range(page_size, len(tokens) + 1, page_size)}
            return keys

        def model_match(self, tokens, salt) -> list[int]:
            slot_ids: list[int] = []
            for end in range(page_size, len(tokens) + 1, page_size):
                page = self.model.get((salt, tuple(tokens[:end])))
                if page is None:
                    break
                slot_ids.extend(page)
            return slot_ids

        # -------------------------------------------------------------- invariants

        @invariant()
        def accounting_and_ownership(self):
            if self.cache is None:
                return
            in_flight = [s for r in self.requests for s in r.slot_ids[r.num_cached:]]
            self.cache.check_integrity(in_flight_slots=in_flight)  # free+evictable+locked+in-flight==total
            tree_slots = self.cache.all_slot_ids()
            model_slots = [s for page in self.model.values() for s in page]
            assert sorted(tree_slots) == sorted(model_slots), "tree and model cache different slots"

        @invariant()
        def locked_prefixes_survive(self):
            if self.cache is None:
                return
            locked_keys = set()
            for req in self.requests:
                assert self.model_match(req.tokens[:req.num_cached], req.salt) == req.slot_ids[:req.num_cached]
                for end in range(page_size, req.num_cached + 1, page_size):
                    locked_keys.add((req.salt, tuple(req.tokens[:end])))
            pinned_keys = {(salt, tuple(tokens[:end])) for salt, tokens, _ in self.pins
                           for end in range(page_size, len(tokens) + 1, page_size)}
            assert pinned_keys <= set(self.model), "a pinned prefix was evicted"
            assert self.cache.pinned_size == len(pinned_keys - locked_keys) * page_size
            locked_keys |= pinned_keys
            assert self.cache.locked_size == len(locked_keys) * page_size
            assert self.cache.evictable_size == (len(self.model) - len(locked_keys)) * page_size

        @invariant()
        def matches_are_longest_prefix_and_salts_never_share(self):
            if self.cache is None:
                return
            probes = [list(prefix) + [3] for _, prefix in self.model] + [r.tokens for r in self.requests]
            for tokens in probes:
                for salt in SALTS:
                    expected = self.model_match(tokens, salt)
                    assert self.cache.peek_prefix(tokens, salt) == expected
                    # A match resumed from the cursor an earlier step left (the tree changed since) is as long.
                    key = (salt, tuple(tokens))
                    num, self.cursors[key] = self.cache.match_cursor(tokens, salt, cursor=self.cursors.get(key))
                    assert num == len(expected), "a resumed match disagrees with a fresh one"

    return RadixMachine


def _round_up(num: int, multiple: int) -> int:
    return -(-num // multiple) * multiple


def _run(page_size: int, num_slots: int) -> None:
    stats: Counter = Counter()
    run_state_machine_as_test(make_machine(page_size, num_slots, stats), settings=STATE_MACHINE_SETTINGS)
    assert stats[LOCKED_EVICTION] > 0, "no example evicted while nodes were locked"
    assert stats["path pinned"] > 0, "no example pinned a finished path"


def test_radix_state_machine_page_size_1():
    _run(page_size=1, num_slots=16)


def test_radix_state_machine_page_size_4():
    _run(page_size=4, num_slots=64)


# As hypothesis marks its own StateMachine.TestCase.runTest: lets `pytest --hypothesis-show-statistics`
# report the events (cache hits, eviction with locked nodes present, ...) for these tests.
test_radix_state_machine_page_size_1.is_hypothesis_test = True
test_radix_state_machine_page_size_4.is_hypothesis_test = True
