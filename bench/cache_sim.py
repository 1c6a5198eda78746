"""Replay a realised trace through a token-level prefix cache of a fixed capacity, under LRU or Bélády eviction.

The yardsticks of bench/agent_trace.py: the same requests, at the times the server actually sent and finished
them, through a cache of the server's KV capacity. A request's prompt is matched against the cache when it is
admitted (the server's admission time where the trace has it, else its send), its prompt and its output hold slots
while it runs (locked), and when it finishes its prompt and output (less the last token, whose KV no step computed)
stay cached until evicted. Eviction takes one unlocked leaf token at a time:

- ``lru``: the one used longest ago;
- ``belady``: the one whose next use (the first later request whose prompt passes through it) is furthest away,
  never-again first. With paths of different lengths this is a yardstick, not the optimum.
- ``online``: Bélády's rule on what a server can know at the time, its best online yardstick: a request already
  sent (its arrival known) is the next use of what it passes through; a path whose session has closed is never used
  again; any other path's next use is expected at its age's mean residual of the trace's return gaps (a session's
  finish to its next send: the distribution a server learns as they come, `scheduler/return_gaps.py`), of the
  gaps after calls of the same tool where the trace names the tool a request called. What separates it from
  Bélády is only each tool call's actual latency.

A request whose locked prefix, new tokens and output do not fit beside the running requests' waits, as the
server's queue would make it, first come first served, until finishes free the room; it then runs as long as it
did on the server (its finish moves by its wait, counted in `deferred` and `deferred_s`). Only a request that does
not fit alone runs over the capacity (`overflow`, in tokens).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

from ..scheduler.return_gaps import ReturnGaps

POLICIES = ("lru", "online", "belady")
_SERIALS = itertools.count()
_MOD = (1 << 61) - 1
_BASE = 1_000_003


@dataclass(frozen=True)
class TraceRequest:
    sent_s: float
    done_s: float
    prompt: Sequence[int]
    output: Sequence[int]
    admitted_s: float | None = None  # when the server admitted it (None: when it was sent)
    session: Hashable | None = None  # the agent (session) it belongs to
    closes: bool = False  # its session ends when it finishes (nobody continues its path)
    tool: Hashable | None = None  # the tool it called, where the server knows (its session returns after it)

    @property
    def start_s(self) -> float:
        return self.sent_s if self.admitted_s is None else self.admitted_s


class _Node:
    __slots__ = ("parent", "token", "key", "children", "locks", "last", "session", "serial")

    def __init__(self, parent: _Node | None, token: int, key: int) -> None:
        self.parent, self.token, self.key = parent, token, key
        self.children: dict[int, _Node] = {}
        self.locks, self.last = 0, 0.0
        self.serial = next(_SERIALS)  # ties in the eviction rank break by creation order, not by memory address
        self.session: Hashable | None = None  # the session of the request that last used it


def _key(parent_key: int, token: int) -> int:
    return (parent_key * _BASE + token + 1) % _MOD


class _Cache:
    def __init__(self, capacity: int, policy: str, uses: dict[int, list[float]],
                 knowledge: _Knowledge | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.capacity, self.policy, self.uses, self.knows = capacity, policy, uses, knowledge
        self.root = _Node(None, -1, 0)
        self.cached = self.in_flight = self.overflow = 0
        self.locked = 0  # cached tokens some running request's path holds
        self.now = 0.0

    def _next_use(self, node: _Node) -> float:
        times = self.uses.get(node.key, ())
        i = bisect.bisect_right(times, self.now)
        return times[i] if i < len(times) else float("inf")

    def _rank(self, node: _Node) -> tuple[float, float]:
        """Smallest first is evicted first."""
        if self.policy == "lru":
            return (node.last, 0.0)
        if self.policy == "belady":
            return (-self._next_use(node), node.last)
        return (-self.knows.expected_use(node, self.now), node.last)

    def _evictable_leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.children:
                    stack.append(child)
                elif child.locks == 0:
                    out.append(child)
        return out

    def make_room(self, need: int) -> None:
        """Evict until `need` more slots are free (or nothing unlocked is left: overflow)."""
        short = self.cached + self.in_flight + need - self.capacity
        if short <= 0:
            return
        heap = [(self._rank(leaf), leaf.serial, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        while short > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.token]
            self.cached -= 1
            short -= 1
            if parent is not self.root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (self._rank(parent), parent.serial, parent))
        self.overflow += max(short, 0)

    def walk(self, tokens: Sequence[int], create: bool, lock: int, start: _Node | None = None,
             session: Hashable | None = None) -> tuple[int, _Node]:
        """Follow (with `create`, extend) the path of `tokens` from `start` (the root), touching and (un)locking
        it; returns how many of them were cached and the node it ends at."""
        node, matched = start or self.root, 0
        for tok in tokens:
            child = node.children.get(tok)
            if child is None:
                if not create:
                    break
                child = node.children[tok] = _Node(node, tok, _key(node.key, tok))
                self.cached += 1
            else:
                matched += 1
            self.locked += int(child.locks == 0 and lock > 0) - int(child.locks + lock == 0 and lock < 0)
            child.locks += lock
            child.last = self.now
            if child.session is None or child.session == session:
                child.session = session
            elif session is not None:
                child.session = _SHARED
            node = child
        return matched, node

    def fits(self, tokens: Sequence[int], extra: int) -> bool:
        """Whether a request with this prompt (its cached prefix locked) and `extra` more slots (its new tokens and
        output) fits beside what is locked and in flight now."""
        node, unlocked, matched = self.root, 0, 0
        for tok in tokens:
            node = node.children.get(tok)
            if node is None:
                break
            matched += 1
            unlocked += node.locks == 0
        return self.locked + unlocked + self.in_flight + len(tokens) - matched + extra <= self.capacity


_SHARED = object()  # a node's session when requests of more than one session used it


class _Knowledge:
    """What the ``online`` yardstick knows at a time: the requests already sent (which prefixes they will use), the
    sessions closed, the distribution of return gaps and, where the trace names them, the tool each session's last
    finished request called and the gaps after each tool's calls."""

    def __init__(self, requests: Sequence[TraceRequest], uses: dict[int, list[float]]) -> None:
        self.uses, self.sends = uses, _uses(requests, sent=True)
        self.closed: set[Hashable] = set()
        self.called: dict[Hashable, Hashable] = {}  # session -> the tool its last finished request called
        by_tool = _return_gaps(requests)
        self._gaps = {tool: _distribution(gaps) for tool, gaps in by_tool.items()}
        self._all = _distribution([gap for gaps in by_tool.values() for gap in gaps])

    def finished(self, r: TraceRequest) -> None:
        if r.session is None:
            return
        self.called[r.session] = r.tool
        if r.closes:
            self.closed.add(r.session)

    def expected_use(self, node: _Node, now: float) -> float:
        times = self.uses.get(node.key, ())
        i = bisect.bisect_right(times, now)
        if i < len(times) and self.sends[node.key][i] <= now:
            return times[i]  # a request already sent will use it then
        if node.session is _SHARED:
            return now + self._all.remaining(now - node.last)
        if node.session in self.closed:
            return float("inf")
        tool = self.called.get(node.session)
        return now + self._gaps.get(tool, self._all).remaining(now - node.last)


def _distribution(gaps: list[float]) -> ReturnGaps:
    """The whole trace's `gaps` as the engine's estimator holds its window: the same mean residual."""
    dist = ReturnGaps(window=max(len(gaps), 1))
    for gap in gaps:
        dist.add(gap)
    return dist


def _return_gaps(requests: Sequence[TraceRequest]) -> dict[Hashable, list[float]]:
    """Each session's gaps from a request's finish to its next request's send, by the tool the finished request
    called (None where the trace does not name it)."""
    finished: dict[Hashable, TraceRequest] = {}
    gaps: dict[Hashable, list[float]] = {}
    for r in sorted(requests, key=lambda r: r.sent_s):
        if r.session is None:
            continue
        last = finished.get(r.session)
        if last is not None:
            gaps.setdefault(last.tool, []).append(max(r.sent_s - last.done_s, 0.0))
        finished[r.session] = r
    return gaps


def _uses(requests: Sequence[TraceRequest], sent: bool = False) -> dict[int, list[float]]:
    """Prefix key -> the sorted admission times of the requests whose prompt has that prefix (with `sent`: their
    send times, in the same order)."""
    uses: dict[int, list[float]] = {}
    for r in sorted(requests, key=lambda r: r.start_s):
        key = 0
        for tok in r.prompt:
            key = _key(key, tok)
            uses.setdefault(key, []).append(r.sent_s if sent else r.start_s)
    return uses


def simulate(requests: Sequence[TraceRequest], capacity: int, policy: str) -> dict[str, float]:
    """Prompt tokens recomputed, the overflow and the waits, replaying `requests` through a cache of `capacity`
    tokens."""
    uses = _uses(requests) if policy != "lru" else {}
    knows = _Knowledge(requests, uses) if policy == "online" else None
    cache = _Cache(capacity, policy, uses, knows)
    events = [(r.start_s, 1, i) for i, r in enumerate(requests)]  # (time, 0 finish / 1 arrival, request)
    heapq.heapify(events)
    queue: deque[int] = deque()
    out = {"recomputed": 0, "overflow": 0, "deferred": 0, "deferred_s": 0.0}
    running = 0
    while events:
        t, is_arrival, i = heapq.heappop(events)  # a finish before an arrival at the same time
        cache.now = t
        r = requests[i]
        if is_arrival:
            queue.append(i)
        else:  # the output's slots move from in flight to cached; the path is unlocked
            running -= 1
            cache.in_flight -= len(r.output)
            _, node = cache.walk(r.prompt, create=False, lock=-1, session=r.session)
            cache.walk(r.output[:-1], create=True, lock=0, start=node, session=r.session)  # the last: never computed
            if knows is not None:
                knows.finished(r)
        while queue and (running == 0 or cache.fits(requests[queue[0]].prompt, len(requests[queue[0]].output))):
            j = queue.popleft()
            q = requests[j]
            # the prompt's cached part is locked first, so making room for the rest cannot evict it
            matched, node = cache.walk(q.prompt, create=False, lock=1, session=q.session)
            out["recomputed"] += len(q.prompt) - matched
            cache.make_room(len(q.prompt) - matched + len(q.output))
            cache.walk(q.prompt[matched:], create=True, lock=1, start=node, session=q.session)
            cache.in_flight += len(q.output)
            running += 1
            wait = t - q.start_s
            out["deferred"] += wait > 0
            out["deferred_s"] += wait
            heapq.heappush(events, (q.done_s + wait, 0, j))
    out["overflow"] = cache.overflow
    return out
