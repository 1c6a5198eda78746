"""Sessions, and the pins that keep a session's history cached between its turns (ARCHITECTURE §4).

An agent sends a turn, gets a tool call back, runs the tool for seconds, then sends the next turn, whose prompt is
the whole history plus the tool's result. Meanwhile other traffic would push that history out of an LRU cache. A
request that names a session (`SamplingParams.session_id`) leaves its cached path **pinned** when it finishes: a
lock of the radix tree held for the session (`RadixCache.lock(node, pin=True)`), with a time to live. The pin ends
when

- the session's next request is admitted (its own lock takes over: `take`),
- its time to live runs out while memory is under pressure, or MAX_TTL_S after it was made in any case (`expire`,
  called every step, looks at most every EXPIRE_EVERY_S; a chat turn that ended with a final answer rather than
  a tool call keeps at most the shortest one: `settle`),
- the session closes, explicitly or after `idle_timeout_s` without a request (its last path, pinned or not, is
  then the first to evict: nobody continues it), or
- admission needs the slots (`reclaim`): pins never starve admission; the cheapest to recompute per slot go
  first (a pin's recompute time is its length x the measured prefill cost per token, so per slot they tie), and
  among those the one whose session is expected back last (scheduler/return_gaps.py: Bélády's rule on the
  expected next use; a chat turn's tool call names the tool, whose own return gaps then answer: `settle`); or
  admission evicts session histories and the pinned one is expected back later than the unpinned ones it would
  take (`rank_away`).

Under memory pressure a pin is made only if it is expected to pay, that is, to see its session back before
admission reclaims it. Admission reclaims the pins expected back later than the new one first, at the rate it has
reclaimed pinned slots over the last PRESSURE_WINDOW_S, after what the waiting queue needs beyond the free and
evictable slots (`keep`'s `queue_excess`): that gives the new pin a horizon, and it is made only if at least
PIN_ODDS of the observed return gaps are shorter (else `skipped`: it would only have displaced cache that other
requests were about to hit). Once the turn's tool is named, both its expected return (which pins are reclaimed
before it) and the odds come from that tool's gaps, and the decision is made again (`settle`).

The time to live is the cost model: TTL_PER_RECOMPUTE x the time the path would take to prefill again, clamped
to [MIN_TTL_S, MAX_TTL_S], so a long history (expensive to recompute) is kept longer than a short one; and the
memory pressure: a pin whose time ran out stays while no admission has had to reclaim pins for PRESSURE_WINDOW_S
(it costs nothing while the pool has room: eviction takes unpinned paths first, and `reclaim` takes the
longest-expired pins first). Pinned slots
are locked slots: the KV identity holds with them (free + evictable + locked + in flight = total), and
`RadixCache.pinned_size` says how many dropping every pin would make evictable.
"""
from __future__ import annotations

import heapq
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..radix.radix_cache import RadixCache, TreeNode
from .checks import check_session_id
from .return_gaps import ReturnGaps, ToolGaps

IDLE_TIMEOUT_S = 600.0  # a session without a request for this long closes (its pin goes)
TTL_PER_RECOMPUTE = 50.0  # a pin lives this many times its path's recompute time...
MIN_TTL_S, MAX_TTL_S = 2.0, 120.0  # ...within these bounds
PRESSURE_WINDOW_S = 10.0  # a reclaim this recent means memory is under pressure: expired pins go
ADMISSION_RATIO = 1.5  # load control (`starts`): the started programs' histories fit in this many pools...
BEHIND_S = 5.0  # ...while the server is behind: the waiting queue's prefill would take this long (a burst that
# clears in seconds is no overload: model S's peak at 2.8 s on bench/agent_replay, holds there only cost p99)...
BEHIND_LATCH_S = 30.0  # ...within this long (a burst's starts must not all slip in before the queue grows)
RETURN_HORIZON_S = 60.0  # an away session's history counts as coming back for this long after its last turn
MAX_START_WAIT_S = 120.0  # load control holds a session's start at most this long
PIN_ODDS = 0.5  # under pressure, pin only if this share of the observed returns would come before the reclaim
EXPIRE_EVERY_S = 0.25  # expire's scan of the pins and sessions is O(open sessions): not every step
DEFAULT_PREFILL_S_PER_TOKEN = 1e-3  # until a step measures it


@dataclass
class _Left:
    node: TreeNode  # the path the session's last finished request left cached
    tokens: int
    queue_excess: int  # what the waiting queue needed then beyond the free and evictable slots


@dataclass
class _Pin:
    node: TreeNode
    tokens: int
    expires: float  # the cost model's time to live ends
    made: float


class Sessions:
    def __init__(self, tree: RadixCache, clock: Callable[[], float] = time.monotonic,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, enabled: bool = True,
                 admission_ratio: float = ADMISSION_RATIO) -> None:
        self._tree, self._clock, self.idle_timeout_s = tree, clock, idle_timeout_s
        self.enabled = enabled  # off: sessions open and close, but no path is kept (so none is demoted or ranked)
        self.admission_ratio = admission_ratio  # load control (`starts`); 0: off
        self._admitted: set[str] = set()  # open sessions a request of which was admitted
        self._starting: dict[str, float] = {}  # session -> when load control first held its start
        self.starts_held = 0  # sessions whose start load control held, since the engine started
        self.behind_s = BEHIND_S
        self._behind_at = float("-inf")  # when the waiting queue's prefill last took behind_s or more
        self._last_seen: dict[str, float] = {}  # open sessions -> the time of their last request
        self._pins: dict[str, _Pin] = {}
        self.prefill_s_per_token = DEFAULT_PREFILL_S_PER_TOKEN
        self._next_expiry = float("-inf")  # when expire next scans
        self._pressure_at = float("-inf")  # when an admission last had to reclaim pins
        self._evicted_at = float("-inf")  # when an admission last had to evict cached paths
        self._finished: dict[str, float] = {}  # session -> when its last request finished (for the return gap)
        self._left: dict[str, _Left] = {}  # session -> what its last finished request left cached
        self.gaps = ToolGaps()
        self._called: dict[str, str] = {}  # session -> the tool(s) its last turn called (settle)
        self._reclaimed: deque[tuple[float, int]] = deque()  # (when, own slots) of the recent reclaims
        self.counts = dict.fromkeys(("pinned", "used", "expired", "reclaimed", "closed", "settled", "skipped"), 0)
        self.on_close: Callable[[str], None] | None = None  # told of every session that closes (kv_swap.py)

    # -- sessions ---------------------------------------------------------------------

    def open(self, session_id: str | None = None) -> str:
        """Open a session (a new id when None; an open one is touched)."""
        sid = check_session_id(session_id) if session_id is not None else uuid.uuid4().hex
        self._last_seen[sid] = self._clock()
        return sid

    def close(self, session_id: str) -> bool:
        """Close a session and drop its pin; False when it was not open."""
        if self._last_seen.pop(session_id, None) is None:
            return False
        self._admitted.discard(session_id)
        self._starting.pop(session_id, None)
        self._finished.pop(session_id, None)
        self._called.pop(session_id, None)
        left = self._left.pop(session_id, None)
        if self.on_close is not None:
            self.on_close(session_id)
        if not self._drop(session_id, "closed") and left is not None and not left.node.is_evicted:
            self._tree.demote(left.node)  # unpinned (skipped under pressure), it still goes first: nobody continues it
        return True

    def is_open(self, session_id: str | None) -> bool:
        return session_id is not None and session_id in self._last_seen

    @property
    def num_open(self) -> int:
        return len(self._last_seen)

    # -- load control -----------------------------------------------------------------

    def starts(self, session_id: str | None) -> bool:
        """Whether load control holds a request of `session_id` that would start it (no request of it admitted yet)
        to the load: starting a program commits memory to all its later turns, and once the histories the started
        programs bring back exceed the pool they evict each other's between turns and recompute them (thrashing).
        So while the server is behind (`observe_backlog`), the planner admits a start only while `returning_tokens`, the
        running requests and the start itself fit in `admission_ratio` pools (or nothing runs); waiting, it starts
        as soon as a program ends, or once it has waited MAX_START_WAIT_S (programs that never end must not shut new
        ones out). A server that keeps up starts every program at once: the recompute of thrashing histories then
        costs time it has, and a held first turn would only wait."""
        if not self.enabled or self.admission_ratio <= 0 or session_id is None or session_id in self._admitted:
            return False
        now = self._clock()
        if now - self._behind_at > BEHIND_LATCH_S:
            return False
        return now - self._starting.get(session_id, now) < MAX_START_WAIT_S

    def hold(self, session_id: str) -> None:
        """The planner holds the start of `session_id` (`starts`, over the load): its wait counts from the first."""
        if session_id not in self._starting:
            self._starting[session_id] = self._clock()
            self.starts_held += 1

    def observe_backlog(self, num_tokens: int) -> None:
        """The waiting queue needs `num_tokens` uncached tokens computed (each step): at the measured prefill cost,
        behind_s or more of it means the server is behind, for BEHIND_LATCH_S from then."""
        if num_tokens * self.prefill_s_per_token >= self.behind_s:
            self._behind_at = self._clock()

    def returning_tokens(self) -> int:
        """The history tokens of the started sessions that are coming back: those waiting in the queue and those away
        for less than RETURN_HORIZON_S since their last turn finished (pinned or not, cached or not)."""
        now = self._clock()
        return sum(left.tokens for sid, left in self._left.items()
                   if now - self._finished.get(sid, now) < RETURN_HORIZON_S)

    # -- pins -------------------------------------------------------------------------

    def take(self, session_id: str | None) -> None:
        """A request of the session was admitted (its own lock holds what it matched): the session's pin ends. A
        request naming a session that is not open opens it."""
        if session_id is None:
            return
        self._last_seen[session_id] = self._clock()
        self._admitted.add(session_id)
        self._starting.pop(session_id, None)
        self._left.pop(session_id, None)
        if self._drop(session_id, None):
            self.counts["used"] += 1

    def arrived(self, session_id: str | None) -> None:
        """A request of the session joined the waiting queue: its return gap is observed."""
        finished = self._finished.pop(session_id, None) if session_id is not None else None
        if finished is not None:
            self.gaps.add(self._clock() - finished, self._called.get(session_id))

    def keep(self, session_id: str | None, node: TreeNode, tokens: int, queue_excess: int = 0) -> None:
        """Pin the path a finished request of the session leaves cached (ending at `node`, `tokens` long), unless
        fewer than PIN_ODDS of the observed returns would come within the pin's horizon (`_horizon`; the waiting
        queue needs `queue_excess` slots beyond the free and evictable ones): admission would reclaim it first."""
        if not self.enabled or session_id is None or session_id not in self._last_seen or tokens == 0 or node.is_root:
            return
        self._drop(session_id, None)
        self._called.pop(session_id, None)  # this turn's call, if any, is named by settle
        now = self._finished[session_id] = self._clock()
        left = self._left[session_id] = _Left(node, tokens, queue_excess)
        if self.gaps.all.within(self._horizon(now, queue_excess, self.gaps.all)) < PIN_ODDS:
            self.counts["skipped"] += 1
            return
        self._pin(session_id, left, now)

    def _pin(self, session_id: str, left: _Left, made: float) -> None:
        self._tree.lock(left.node, pin=True)
        ttl = min(max(TTL_PER_RECOMPUTE * left.tokens * self.prefill_s_per_token, MIN_TTL_S), MAX_TTL_S)
        self._pins[session_id] = _Pin(left.node, left.tokens, made + ttl, made)
        self.counts["pinned"] += 1

    def rebase(self, session_id: str | None, node: TreeNode, tokens: int) -> None:
        """A warm-up of the session finished (a prefix-only request: the server's prefetch of the history as the
        next turn will render it, frontend/rewrite_prefetch.py): what the session's last turn left is now that
        path, and its pin, if it has one, moves there. Not a turn: the return gap, the tool and the pin's time to
        live stay the last turn's."""
        left = self._left.get(session_id) if session_id is not None else None
        if left is None or tokens == 0 or node.is_root:
            return
        self._left[session_id] = _Left(node, tokens, left.queue_excess)
        pin = self._pins.get(session_id)
        if pin is not None:
            self._tree.lock(node, pin=True)  # before the old pin goes: the shared prefix is never unpinned between
            self._tree.unlock(pin.node, pin=True)
            pin.node, pin.tokens = node, tokens

    def settle(self, session_id: str, tool: str | None = None) -> bool:
        """The session's turn ended with a call of `tool` (the names of the tools called): the session is expected
        back from that tool's return gaps, and keep's decision to pin or not is made again from them (`_revise`).
        Or with a final answer (None): the agent may not come back, so its pin keeps at most the shortest time to
        live. False when the session is not open, or for a final answer holds no pin."""
        if tool is not None:
            if session_id not in self._last_seen:
                return False
            self._called[session_id] = tool
            self._revise(session_id)
            return True
        pin = self._pins.get(session_id)
        if pin is None:
            return False
        pin.expires = min(pin.expires, self._clock() + MIN_TTL_S)
        self.counts["settled"] += 1
        return True

    def _revise(self, session_id: str) -> None:
        """Pin the session's last path, or not, by whether PIN_ODDS of its tool's returns come within the horizon
        its tool's expected return gives it beside the queue keep saw. A tool without enough returns of its own
        says nothing keep did not know: keep's decision stands."""
        left = self._left.get(session_id)
        gaps = self.gaps.of(self._called[session_id])
        if left is None or left.node.is_evicted or gaps is self.gaps.all:
            return
        worth = gaps.within(self._horizon(self._clock(), left.queue_excess, gaps)) >= PIN_ODDS
        if worth == (session_id in self._pins):
            return
        if worth:
            self.counts["skipped"] -= 1
            self._pin(session_id, left, self._finished.get(session_id, self._clock()))
        else:
            self._drop(session_id, None)
            self.counts["pinned"] -= 1
            self.counts["skipped"] += 1

    def expire(self) -> None:
        """Drop the pins whose time ran out, if memory is under pressure, and those made MAX_TTL_S ago; close the
        sessions idle past the timeout (a scan at most every EXPIRE_EVERY_S: the engine calls this every step)."""
        now = self._clock()
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRE_EVERY_S
        pressure = now - self._pressure_at <= PRESSURE_WINDOW_S
        for sid in [s for s, pin in self._pins.items()
                    if (pin.expires <= now and pressure) or now - pin.made >= MAX_TTL_S]:
            self._drop(sid, "expired")
        for sid in [s for s, seen in self._last_seen.items() if now - seen > self.idle_timeout_s]:
            self.close(sid)
        for sid in [s for s, since in self._starting.items() if now - since > self.idle_timeout_s]:
            del self._starting[sid]  # a start aborted while it waited

    def reclaim(self, num_slots: int) -> None:
        """Drop pins, the session expected back last first (per slot their recompute costs tie), until `num_slots`
        more are evictable or no pin is left."""
        target = self._tree.evictable_size + num_slots
        now = self._pressure_at = self._clock()
        order = sorted(self._pins, key=lambda s: self.expected_return(s, now), reverse=True)
        for sid in order:
            if self._tree.evictable_size >= target:
                break
            self._reclaim_pin(sid, now)

    def _reclaim_pin(self, session_id: str, now: float) -> None:
        """Admission takes the session's pin (its slots count towards the reclaim rate `_horizon` sees)."""
        self._reclaimed.append((now, _own_slots(self._pins[session_id].node)))
        self._drop(session_id, "reclaimed")

    def rank_away(self, num_slots: int) -> None:
        """Admission is about to evict `num_slots`. Of the histories of sessions away without a pin (skipped,
        reclaimed or expired), LRU would take as many slots as its order reaches among its first `num_slots`; those
        slots go, but from the sessions expected back last among every away session, pinned or not (Bélády's rule
        on the expected next use, where LRU takes the oldest and a pin would keep a session due in a minute over
        one due now: a pin taken here is reclaimed). A session whose next request is already waiting is not away.
        What else is cached keeps its place in the order."""
        now = self._clock()
        away = {self._left[sid].node: sid for sid in self._finished
                if sid not in self._pins and sid in self._left and not self._left[sid].node.is_evicted}
        if not away:
            return
        share = seen = 0
        for leaf in self._tree.candidates():
            if seen >= num_slots:
                break
            slots = _own_slots(leaf, held=0) if leaf in away else len(leaf.value)
            seen += slots
            share += slots if leaf in away else 0
        # latest expected back first, popped lazily: a heap, as only the first few are usually reached
        order = [(-self._expected(sid, self._finished[sid], now), n, sid)
                 for n, sid in enumerate([*away.values(), *(s for s in self._pins if s in self._finished)])]
        heapq.heapify(order)
        covered = rank = 0
        while order and covered < share:
            sid, rank = heapq.heappop(order)[2], rank + 1
            if sid in self._pins:
                self._reclaim_pin(sid, now)
            covered += self._tree.demote(self._left[sid].node, rank)

    def expected_return(self, session_id: str, now: float) -> float:
        """When the pinned session's next request is expected (scheduler/return_gaps.py)."""
        return self._expected(session_id, self._pins[session_id].made, now)

    def _expected(self, session_id: str, since: float, now: float) -> float:
        """When the session, away since `since`, is expected back: the mean residual of the return gaps observed
        after calls of the tool its last turn called, or of everyone's."""
        return now + self.gaps.of(self._called.get(session_id)).remaining(now - since)

    def _horizon(self, now: float, queue_excess: int, gaps: ReturnGaps) -> float:
        """How long a pin made now, its session expected back after `gaps`' mean, would last: admission reclaims the
        pins expected back later than it first; what they hold beyond the waiting queue's `queue_excess` goes at the
        rate admission reclaimed pinned slots in the last PRESSURE_WINDOW_S. No pressure (no reclaim, the queue
        fits): it lasts; the queue's excess alone would reclaim it: none."""
        while self._reclaimed and self._reclaimed[0][0] < now - PRESSURE_WINDOW_S:
            self._reclaimed.popleft()
        rate = sum(slots for _, slots in self._reclaimed) / PRESSURE_WINDOW_S
        if rate <= 0 and queue_excess <= 0:
            return float("inf")
        when = now + gaps.remaining(0.0)
        later = sum(_own_slots(pin.node) for sid, pin in self._pins.items() if self.expected_return(sid, now) > when)
        left = later - max(queue_excess, 0)
        if left <= 0:
            return 0.0
        return left / rate if rate > 0 else float("inf")

    def note_eviction(self) -> None:
        """An admission had to evict cached paths to find its slots."""
        self._evicted_at = self._clock()

    def under_pressure(self) -> bool:
        """Whether memory is under pressure: an admission evicted cached paths or reclaimed pins in the last
        PRESSURE_WINDOW_S (program scheduling then yields to the cache: scheduler/fair_share.py)."""
        return self._clock() - max(self._pressure_at, self._evicted_at) <= PRESSURE_WINDOW_S

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step's measured prefill cost (moving average per token), for the time to live of new pins."""
        if num_tokens > 0 and seconds > 0:
            self.prefill_s_per_token += 0.2 * (seconds / num_tokens - self.prefill_s_per_token)

    def stats(self) -> dict[str, int]:
        return {"num_sessions": len(self._last_seen), "num_pins": len(self._pins),
                "pinned_slots": self._tree.pinned_size, "num_tool_returns": self.gaps.named,
                "num_starts_held": self.starts_held,
                **{f"num_pins_{name}": value for name, value in self.counts.items()}}

    def drop_all(self) -> None:
        """Every pin goes (a cache flush); the sessions stay open."""
        for sid in list(self._pins):
            self._drop(sid, None)

    def _drop(self, session_id: str, reason: str | None) -> bool:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self._tree.unlock(pin.node, pin=True)
        if reason in ("closed", "expired"):  # nobody is expected back: its own path is the first to evict
            self._tree.demote(pin.node)
        if reason is not None:
            self.counts[reason] += 1
        return True


def _own_slots(node: TreeNode, held: int = 1) -> int:
    """The slots of the path ending at `node` that only its one lock (a pin) holds; `held=0`: that no lock holds
    and no other path uses."""
    own = 0
    while not node.is_root and node.lock_ref == held:
        own += len(node.value)
        node = node.parent
        if held == 0 and len(node.children) > 1:
            break
    return own
