"""Request-level KV bookkeeping over the radix tree and the slot allocator.

Every slot is in exactly one of four states, and the counts always add up:

    free (allocator) + evictable (tree, unlocked) + locked (tree) + in-flight (owned by
    running requests, not in the tree) == total slots

A request's slots ``kv_slots[:tree_len]`` belong to the tree and are locked through
``req.last_node``; ``kv_slots[tree_len:]`` are its own (whole pages, incl. the unused tail
of its last page). This module decides which slots a request holds; its ``SlotRow``
(scheduler/slot_row.py) records them, together with its row of the runner's request->slot table.
"""
from __future__ import annotations

import logging

from ..radix.allocator import KVAllocator
from ..radix.radix_cache import DEFAULT_REUSE_BONUS, RadixCache, TreeNode
from .kv_swap import SessionSwap
from .req import Req
from .sessions import ADMISSION_RATIO, Sessions
from .slot_row import SlotRows

logger = logging.getLogger(__name__)

# A decoding request takes the slots of its next this-many tokens at once (when the pool has them
# free twice over): its generated tokens' K/V then lie in runs of consecutive slots, which the
# attention streams, instead of one slot per step scattered between the other requests'.
DECODE_AHEAD = 16


class PrefixKV:
    def __init__(self, num_slots: int, page_size: int, disable_cache: bool, eviction_policy: str,
                 num_rows: int = 64, reuse_bonus: float = DEFAULT_REUSE_BONUS, agent_cache: bool = True,
                 admission_ratio: float = ADMISSION_RATIO, swap: SessionSwap | None = None):
        self.page_size = page_size
        self.rows = SlotRows(num_rows)
        self.allocator = KVAllocator(num_slots, page_size)
        self.tree = RadixCache(self.allocator, page_size=page_size, disable=disable_cache,
                               eviction_policy=eviction_policy, reuse_bonus=reuse_bonus)
        # Pins of finished requests' paths for their sessions' next turns, and eviction that looks ahead; off (the
        # agent-trace baseline) the cache is plain LRU with reuse.
        self.agent_cache = agent_cache
        self.sessions = Sessions(self.tree, enabled=agent_cache, admission_ratio=admission_ratio)
        # Open sessions' histories copied to disk before eviction may take them, read back when the tree lost them
        # (kv_swap.py); a finished request's path waits in _unsaved (token ids and the tree's slots, no copy) until
        # the next eviction, so a pool that never evicts never writes.
        self.swap = swap if agent_cache and not disable_cache else None
        self._unsaved: dict[str, tuple[str | None, list[int], list[int]]] = {}  # session -> (salt, ids, slots)
        if self.swap is not None:
            self.sessions.on_close = self._closed
        self._hinted_need: dict[int, int] = {}  # id(waiting request) -> its uncached tokens when hinted
        self.waiting_need = 0  # their sum: the slots the waiting queue will ask for

    @property
    def total_slots(self) -> int:
        return self.allocator.total_slots

    def available_slots(self) -> int:
        """Slots obtainable now without retracting anyone: free + evictable + those only pins hold (admission
        drops pins when it needs their slots: they never starve it)."""
        return self.allocator.num_free_slots + self.tree.evictable_size + self.tree.pinned_size

    def history_room(self) -> float:
        """Load control's bound on the histories of started sessions (Sessions.starts): `admission_ratio` pools,
        and the swap tier's tokens besides, where histories the pool cannot keep go at the cost of a copy, not of
        their recompute."""
        tier = self.swap.capacity_tokens if self.swap is not None else 0
        return self.sessions.admission_ratio * self.total_slots + tier

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_cap(self, req: Req) -> int:
        # The last token is always computed (its logits are needed); prompt logprobs need
        # the logits before logprob_start_len, so the match stops one token earlier there.
        cap = req.seq_len - 1
        if req.params.logprob_start_len is not None:
            cap = min(cap, max(req.params.logprob_start_len - 1, 0))
        return cap

    def match(self, req: Req, record_hit: bool = True) -> tuple[list[int], TreeNode]:
        """The request's cached prefix as admission would take it: (its slots, the node to lock)."""
        return self.tree.match_prefix(req.tree_ids(self.match_cap(req)), salt=req.tree_salt, record_hit=record_hit)

    def hint(self, waiting: list[Req]) -> None:
        """Waiting requests expect to use their cached prefixes: eviction takes every path nobody waits for first
        (RadixCache.hint; a preference, never a ban). Once per stay in the queue (`admit` and `unhint` end it), one
        walk for all the choices of a prompt."""
        if self.tree.disable or not self.agent_cache:
            return
        walked: dict[tuple, tuple[list[int], TreeNode]] = {}
        for req in waiting:
            if req.hint_node is None:
                key = (id(req.prompt_ids), req.params.cache_salt, self.match_cap(req))
                if key not in walked:
                    walked[key] = self.match(req, record_hit=False)
                slots, req.hint_node = walked[key]
                self.tree.hint(req.hint_node)
                need = self._hinted_need[id(req)] = req.seq_len - len(slots)
                self.waiting_need += need
                if req.cached_tokens is None and not req.prefix_only:  # its first stay in the queue: it just arrived
                    self.sessions.arrived(req.params.session_id)

    def unhint(self, req: Req) -> None:
        if req.hint_node is not None:
            self.tree.unhint(req.hint_node)
            req.hint_node = None
            self.waiting_need -= self._hinted_need.pop(id(req), 0)

    def restore(self, req: Req) -> int:
        """Before the request's admission is decided: read back from the swap tier the pages of its prompt that its
        session's file holds and the tree lost, into free or evictable slots (never a pin's or a running request's),
        and insert them, so its match takes them. Returns the tokens restored."""
        sid = req.params.session_id
        if self.swap is None or sid is None or req.prefix_only or req.restore_epoch == self.tree.epoch:
            return 0  # (the last look found the tree holding all the file has, and the tree has not changed since)
        ids = req.tree_ids(self.match_cap(req))
        held = self.swap.extent(sid, req.tree_salt, ids) // self.page_size * self.page_size
        missing = held - self.tree.match_length(ids[:held], salt=req.tree_salt) if held else 0
        if missing < self.page_size:
            req.restore_epoch = self.tree.epoch
            return 0
        if missing > self.allocator.num_free_slots + self.tree.evictable_size:
            return 0
        slots, node = self.tree.match_prefix(ids[:held], salt=req.tree_salt, record_hit=False)
        self.tree.lock(node)  # the prefix it extends stays while slots are made
        new = self._alloc(missing)
        self.tree.unlock(node)
        if new is None:
            return 0
        if not self.swap.load(sid, len(slots), new):
            self.allocator.free(new)
            return 0
        num_cached, _, _ = self.tree.insert_path(ids[:held], slots + new, salt=req.tree_salt)
        if num_cached > len(slots):  # cannot happen (the prefix was locked, nothing inserted): never leak
            self.allocator.free(new[:num_cached - len(slots)])
        return missing

    def admit(self, req: Req, matched: tuple[list[int], TreeNode] | None = None) -> int:
        """Lock the request's cached prefix and give it a table row; returns the prefix's length. `matched`: the
        planner's match of this step (its node still locked), so the tree is walked once per candidate."""
        if matched is None:
            self.restore(req)
            slots, node = self.match(req)
        else:
            slots, node = matched
            self.tree.record_hit(node)
        self.tree.lock(node)
        self.unhint(req)  # the lock holds what the hint asked for
        if not req.prefix_only:  # a warm-up's own lock holds what it needs; the session's turn is still to come
            self.sessions.take(req.params.session_id)  # the request's lock holds what its session's pin kept
        req.last_node = node
        self.rows.assign(req.slot_row, slots)
        req.kv_len = req.tree_len = len(slots)
        return len(slots)

    def slots_needed(self, req: Req, num_new_tokens: int) -> int:
        """New slots (whole pages) needed so positions up to kv_len + num_new_tokens have one."""
        missing = req.kv_len + num_new_tokens - len(req.kv_slots)
        return self.pages_for(missing) * self.page_size if missing > 0 else 0

    def reserve(self, req: Req, num_new_tokens: int) -> bool:
        """Allocate slots for the next num_new_tokens positions, evicting cached leaves if needed.

        Ahead, when the pool has the slots free twice over (never by evicting): the first chunk
        of a prefill takes the slots of the whole rest of the prompt, so a chunked prompt is one
        run of consecutive slots; a decode takes those of its next DECODE_AHEAD tokens (at most
        what max_new_tokens leaves), so its outputs' K/V form runs too. Slots held ahead and
        never used are freed with the request. Under memory pressure: only what the step needs."""
        need = self.slots_needed(req, num_new_tokens)
        if need == 0:
            return True
        ahead = self.pages_for(self.tokens_ahead(req)) * self.page_size
        if ahead > need and self.allocator.num_free_slots >= 2 * ahead:
            slots = self.allocator.alloc(ahead)
            if slots is not None:
                req.slot_row.extend(slots)
                return True
        slots = self._alloc(need)
        if slots is None:
            return False
        req.slot_row.extend(slots)
        return True

    @staticmethod
    def tokens_ahead(req: Req) -> int:
        """Positions past the slots the request holds that reserve may take at once."""
        rest = req.seq_len - len(req.kv_slots)  # the rest of a prompt
        if req.is_decoding:
            rest = max(rest, min(DECODE_AHEAD, req.params.max_new_tokens - len(req.output_ids)))
        return rest

    @staticmethod
    def held_ahead(req: Req) -> int:
        """Slots the request holds past its sequence (taken ahead, not yet used)."""
        return max(len(req.kv_slots) - req.seq_len, 0)

    def cache_prefix(self, req: Req) -> None:
        """Insert the request's computed whole pages into the tree and re-lock at the new end.

        Slots the tree already had for that range (another request computed the same
        prefix meanwhile) are freed and replaced by the tree's, so nothing is stored twice.
        """
        aligned = (req.kv_len // self.page_size) * self.page_size
        if aligned <= req.tree_len or self.tree.disable:
            return
        own = req.kv_slots
        num_cached, cached, node = self.tree.insert_path(req.tree_ids(aligned), own[:aligned], salt=req.tree_salt)
        if num_cached > req.tree_len:
            self.allocator.free(own[req.tree_len:num_cached])
            req.slot_row.adopt(req.tree_len, cached[req.tree_len:num_cached])
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node = node
        req.tree_len = aligned

    def release(self, req: Req, finished: bool = False) -> None:
        """Finish, abort or retract: keep the computed prefix cached, free the rest, unlock. A `finished` request
        of a session leaves its cached path pinned for the session's next turn."""
        if req.last_node is None:
            return
        self.cache_prefix(req)
        if finished and req.prefix_only:
            self.sessions.rebase(req.params.session_id, req.last_node, req.tree_len)
        elif finished:
            excess = self.waiting_need - self.allocator.num_free_slots - self.tree.evictable_size
            self.sessions.keep(req.params.session_id, req.last_node, req.tree_len, queue_excess=excess)
        if finished:
            self._save(req)  # a rebased history (the next turn's rendering) too
        slots = self.rows.release(req.slot_row)
        if len(slots) > req.tree_len:
            self.allocator.free(slots[req.tree_len:])
        self.tree.unlock(req.last_node)
        req.last_node = None
        req.kv_len = req.tree_len = 0

    def _save(self, req: Req) -> None:
        """The session's history is now the request's cached path: written to its file before the next eviction
        (`_write_unsaved`; the tree's slots stay valid until then: only eviction frees them)."""
        sid = req.params.session_id
        if self.swap is not None and self.sessions.is_open(sid) and req.tree_len:
            self._unsaved[sid] = (req.tree_salt, req.tree_ids(req.tree_len), req.kv_slots[:req.tree_len])

    def _write_unsaved(self) -> None:
        for sid, (salt, ids, slots) in self._unsaved.items():
            self.swap.save(sid, salt, ids, slots)
        self._unsaved.clear()

    def _closed(self, session_id: str) -> None:
        self._unsaved.pop(session_id, None)
        if self.swap is not None:
            self.swap.drop(session_id)

    def flush(self) -> None:
        self.sessions.drop_all()
        if self.swap is not None:
            self._unsaved.clear()
            self.swap.drop_all()
        self.tree.reset()

    def close(self) -> None:
        """The engine shuts down: the swap tier's files go."""
        if self.swap is not None:
            self.swap.close()
            self.swap = None

    def swap_stats(self) -> dict[str, int]:
        return self.swap.stats() if self.swap is not None else {}

    def check_integrity(self, running: list[Req]) -> None:
        self.tree.check_integrity(in_flight_slots=sum(r.owned_slots for r in running))

    def _alloc(self, num_slots: int) -> list[int] | None:
        shortfall = num_slots - self.allocator.num_free_slots
        if shortfall > self.tree.evictable_size:
            self.sessions.reclaim(shortfall - self.tree.evictable_size)
        if shortfall > 0:
            if self._unsaved:
                self._write_unsaved()  # before eviction frees any of their slots
            self.sessions.note_eviction()
            self.sessions.rank_away(shortfall)
            self.tree.evict(shortfall)
        return self.allocator.alloc(num_slots)
