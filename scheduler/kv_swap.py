"""The session swap tier: a second, larger KV tier on disk for the histories of open sessions (ARCHITECTURE §4).

An agent's history leaves the pool while its tool runs whenever other traffic needs the slots (a pin is
reclaimed, or none was worth making), and its next turn then recomputes it: at model L's measured 1.06 ms a
token, 5 s for a 5k-token history. The swap tier keeps a copy on disk instead, as InferCept swaps an intercepted
request's KV out and llama.cpp saves a slot to a file: when a request of an open session finishes, the part of its
cached path the tier does not hold yet is appended to the session's file before the next eviction may take its
slots (scheduler/kv_ops.py defers the copy: a pool that never evicts never writes; a turn adds its tool result and
output, hundreds of tokens, not the history); when a request of the session is about to be admitted and the tier holds
more of its prompt than the tree does, the missing pages are read back into freshly allocated slots and inserted
into the tree, so the request matches them like any cached prefix. A copy is bit for bit the KV that was computed.

The tier holds at most `capacity_tokens` (the bytes given, over the pool's bytes a token); to make room the
session saved least recently goes whole. A session's file goes when it closes (explicitly or idle). Restoring
takes only free and evictable slots (it never reclaims a pin, retracts or waits): a restore that does not fit is
skipped, and the turn computes its history as without the tier. The tree and the allocator never see the tier:
restored slots enter the tree as an insert, so the KV identity holds as before. Here are the bookkeeping and the
decisions; kernels/kv_files.py moves the bytes.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import count
from typing import Any, Protocol, Sequence

logger = logging.getLogger(__name__)


class KVStore(Protocol):
    """Where the bytes go (kernels/kv_files.KVFiles; a test's in-memory stand-in)."""
    bytes_per_token: int

    def write(self, key: int, start: int, slots: list[int]) -> None: ...
    def read(self, key: int, start: int, slots: list[int]) -> None: ...
    def remove(self, key: int) -> None: ...
    def close(self) -> None: ...


@dataclass
class _Entry:
    key: int
    salt: str | None
    ids: list[int] = field(default_factory=list)  # the tree keys of the tokens the file holds


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """len of the longest common prefix: list compares (C speed) in a binary search, O(n log n)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class SessionSwap:
    def __init__(self, store: KVStore, capacity_tokens: int) -> None:
        self._store = store
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently saved first
        self._keys = count()
        self.num_tokens = self.peak_tokens = 0  # held over all sessions, now and at most
        self.counts = dict.fromkeys(("saved", "restored", "restores", "dropped"), 0)

    def save(self, session_id: str, salt: str | None, ids: Sequence[int], slots: Sequence[int]) -> None:
        """A request of the session finished with `ids` cached in `slots`: the session's file holds them from now
        on (it appends what it lacks, cut first where the history was rewritten)."""
        entry = self._entries.pop(session_id, None)
        if entry is not None and entry.salt != salt:
            self._remove(entry)
            entry = None
        if len(ids) > self.capacity_tokens:
            if entry is not None:
                self._remove(entry)
            return
        entry = entry or _Entry(next(self._keys), salt)
        keep = common_prefix(entry.ids, ids)
        self.num_tokens -= len(entry.ids) - keep
        del entry.ids[keep:]
        self._make_room(len(ids) - keep)
        try:
            self._store.write(entry.key, keep, list(slots[keep:len(ids)]))
        except OSError as exc:  # a full or failing disk costs the tier, never the request
            logger.warning("session swap tier: saving failed (%s); the session's history is not kept", exc)
            self._remove(entry)
            return
        entry.ids.extend(ids[keep:])
        self.num_tokens += len(ids) - keep
        self.peak_tokens = max(self.peak_tokens, self.num_tokens)
        self.counts["saved"] += len(ids) - keep
        self._entries[session_id] = entry

    def extent(self, session_id: str | None, salt: str | None, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` the session's file holds."""
        entry = self._entries.get(session_id) if session_id is not None else None
        if entry is None or entry.salt != salt:
            return 0
        return common_prefix(entry.ids, ids)

    def load(self, session_id: str, start: int, slots: list[int]) -> bool:
        """The pool's `slots` get the session's tokens [start, start + len(slots)); False when reading failed (the
        session's file is dropped)."""
        entry = self._entries[session_id]
        try:
            self._store.read(entry.key, start, slots)
        except OSError as exc:
            logger.warning("session swap tier: reading failed (%s); the history is computed again", exc)
            self.drop(session_id)
            return False
        self._entries.move_to_end(session_id)
        self.counts["restored"] += len(slots)
        self.counts["restores"] += 1
        return True

    def drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._remove(entry)

    def drop_all(self) -> None:
        for sid in list(self._entries):
            self.drop(sid)

    def close(self) -> None:
        self._entries.clear()
        self.num_tokens = 0
        self._store.close()

    def stats(self) -> dict[str, int]:
        return {"swap_sessions": len(self._entries), "swap_tokens": self.num_tokens,
                "swap_peak_tokens": self.peak_tokens, "swap_bytes_per_token": self._store.bytes_per_token,
                **{f"swap_{name}": value for name, value in self.counts.items()}}

    def _make_room(self, num_tokens: int) -> None:
        while self._entries and self.num_tokens + num_tokens > self.capacity_tokens:
            _, entry = self._entries.popitem(last=False)
            self._remove(entry)
            self.counts["dropped"] += 1

    def _remove(self, entry: _Entry) -> None:
        self.num_tokens -= len(entry.ids)
        self._store.remove(entry.key)


def session_swap(cfg: Any, runner: Any) -> SessionSwap | None:
    """The tier an EngineConfig asks for (`kv_swap_space` GiB, files in `kv_swap_dir`), over files of the runner's
    pool rows; None when it is off (also with the agent cache or the radix cache off)."""
    if cfg.kv_swap_space <= 0 or cfg.disable_agent_cache or cfg.disable_radix_cache:
        return None
    from ..kernels.kv_files import KVFiles  # torch, kept off the scheduler's import path

    files = KVFiles(runner.k_cache, runner.v_cache, cfg.kv_swap_dir)
    capacity = int(cfg.kv_swap_space * 2**30) // files.bytes_per_token
    logger.info("session swap tier: %d tokens (%.3g GiB, %d bytes a token) in %s", capacity, cfg.kv_swap_space,
                files.bytes_per_token, files.directory)
    return SessionSwap(files, capacity)
