"""When a session's next request is expected (ARCHITECTURE §4): the pins' look-ahead.

An agent's next turn comes after its tool ran: the gap from a session's finished request to its next request's
arrival. `ReturnGaps` keeps the last WINDOW gaps the engine saw (every session's, pinned or not, so that what is
observed does not depend on what survived) and answers the expected remaining wait of a session that has waited
`age` so far: the mean of the observed gaps longer than `age`, less `age` (the mean residual life). For the
heavy-tailed latencies of tools (a search, a shell command, a human) it grows with the age: the longer an agent has
been away, the further its return; for a fixed latency it shrinks. Sessions (scheduler/sessions.py) reclaim the pin
whose return is furthest first, Bélády's rule on expected rather than known next uses, and pin under pressure only
what is expected back before the waiting queue would reclaim it.
"""
from __future__ import annotations

import bisect
from collections import deque
from itertools import accumulate

WINDOW = 256  # recent gaps kept
DEFAULT_GAP_S = 1.0  # the expected gap before any was observed


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
