"""When a session's next request is expected (ARCHITECTURE §4): the pins' look-ahead.

An agent's next turn comes after its tool ran: the gap from a session's finished request to its next request's
arrival. `ReturnGaps` keeps the last WINDOW gaps the engine saw (every session's, pinned or not, so that what is
observed does not depend on what survived) and answers the expected remaining wait of a session that has waited
`age` so far: the mean of the observed gaps longer than `age`, less `age` (the mean residual life). For the
heavy-tailed latencies of tools (a search, a shell command, a human) it grows with the age: the longer an agent has
been away, the further its return; for a fixed latency it shrinks. Sessions (scheduler/sessions.py) reclaim the pin
whose return is furthest first, Bélády's rule on expected rather than known next uses, and pin under pressure only
what is expected back before the waiting queue would reclaim it.

How long an agent is away depends on the tool it called (a calculator returns at once, a human in minutes), and a
chat turn's tool call names it (Continuum's per-tool prediction). `ToolGaps` keeps each tool's own gaps beside
everyone's; a session whose last turn called a tool with at least MIN_OWN gaps observed is expected back from that
tool's, any other from everyone's.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from itertools import accumulate

WINDOW = 256  # recent gaps kept
DEFAULT_GAP_S = 1.0  # the expected gap before any was observed
MIN_OWN = 8  # a tool's own gaps answer once this many were observed
MAX_TOOLS = 64  # tools whose gaps are kept (the most recently called): names come from model output


class ReturnGaps:
    def __init__(self, window: int = WINDOW, default_s: float = DEFAULT_GAP_S) -> None:
        self._gaps: deque[float] = deque(maxlen=window)
        self._default = default_s
        self._sorted: list[float] | None = None
        self._suffix: list[float] = []  # _suffix[i] = sum(_sorted[i:])

    def __len__(self) -> int:
        return len(self._gaps)

    def add(self, gap_s: float) -> None:
        self._gaps.append(max(gap_s, 0.0))
        self._sorted = None

    def within(self, horizon_s: float) -> float:
        """The share of observed gaps no longer than `horizon_s` (the default gap's side of it without any)."""
        if not self._gaps:
            return float(self._default <= horizon_s)
        self._sort()
        return bisect.bisect_right(self._sorted, horizon_s) / len(self._sorted)

    def _sort(self) -> None:
        if self._sorted is None:
            self._sorted = sorted(self._gaps)
            self._suffix = list(accumulate(reversed(self._sorted)))[::-1] + [0.0]

    def remaining(self, age_s: float) -> float:
        """The expected wait left for a session that has been away `age_s` seconds. Without observations the
        default gap (or the age itself, once longer: it is as likely to be away as long again); past every gap
        observed, the age itself as well."""
        if not self._gaps:
            return max(self._default - age_s, age_s)
        self._sort()
        i = bisect.bisect_right(self._sorted, age_s)
        longer = len(self._sorted) - i
        return self._suffix[i] / longer - age_s if longer else age_s


class ToolGaps:
    """Everyone's return gaps (`all`) and each tool's: `of(tool)` answers for a session whose last turn called
    `tool` (None: no tool named, a token-level turn), from the tool's own gaps once it has MIN_OWN of them."""

    def __init__(self, window: int = WINDOW, default_s: float = DEFAULT_GAP_S) -> None:
        self.all = ReturnGaps(window, default_s)
        self._window = window
        self._by_tool: OrderedDict[str, ReturnGaps] = OrderedDict()
        self.named = 0  # gaps observed after a named tool call

    def add(self, gap_s: float, tool: str | None = None) -> None:
        self.all.add(gap_s)
        if tool is None:
            return
        self.named += 1
        own = self._by_tool.setdefault(tool, ReturnGaps(self._window))
        own.add(gap_s)
        self._by_tool.move_to_end(tool)  # most recently called last
        if len(self._by_tool) > MAX_TOOLS:
            self._by_tool.popitem(last=False)

    def of(self, tool: str | None) -> ReturnGaps:
        own = self._by_tool.get(tool) if tool is not None else None
        return own if own is not None and len(own) >= MIN_OWN else self.all
