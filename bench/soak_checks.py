"""The soak's verdict: pure checks over the recorded outcomes, the RSS samples and the server's idle state.

Each check returns the violations it found as sentences; an empty list is a clean run."""
from __future__ import annotations

import collections
from typing import Any, Sequence

from .soak_traffic import Outcome

RSS_GROWTH_MB = 50.0  # per process, between the end of the warm-up and the end of the run
SERVER_ERRORS = ("500", "502", "503", "504")
# What each kind may legitimately end in (besides a kill window, where the engine's death excuses 5xx and errors).
ALLOWED = {
    "malformed": lambda s: s.startswith("4"),
    "burst": lambda s: s in ("200", "429"),
    "hangup": lambda s: s in ("hangup", "200"),  # a short answer may end before the client leaves
    "abort_request": lambda s: s in ("200", "404"),  # 404: the request had already finished
}


def in_window(t: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(lo <= t <= hi for lo, hi in windows)


def violating(outcomes: Sequence[Outcome], kill_windows: Sequence[tuple[float, float]] = ()) -> list[Outcome]:
    """The requests without an allowed terminal outcome: a hang, a 5xx (an aborted request included), a transport
    failure, a stream cut or errored, a malformed request not answered 4xx; a 429 (the queue was full: a clear
    answer under a burst) is allowed for any request; kill windows excuse all but hangs."""
    out = []
    for o in outcomes:
        if o.status != "timeout" and (in_window(o.start, kill_windows)
                                      or in_window(o.start + o.latency_s, kill_windows)):
            continue
        allowed = ALLOWED.get(o.kind, lambda s: s == "200")
        if o.status == "timeout" or not (allowed(o.status) or o.status == "429"):
            out.append(o)
    return out


def outcome_violations(outcomes: Sequence[Outcome], kill_windows: Sequence[tuple[float, float]] = ()) -> list[str]:
    """violating(), counted by kind and outcome, as sentences."""
    bad = collections.Counter((o.kind, "hung past the client deadline" if o.status == "timeout" else f"ended {o.status}")
                              for o in violating(outcomes, kill_windows))
    return [f"{n} {kind} request(s) {what}" for (kind, what), n in sorted(bad.items())]


def rss_violations(samples: dict[str, list[tuple[float, float]]], warmup_end: float,
                   limit_mb: float = RSS_GROWTH_MB) -> list[str]:
    """samples: process -> [(time, RSS MB)]; growth from the first sample at or after the warm-up's end to the last."""
    out = []
    for name, series in samples.items():
        growth = rss_growth(series, warmup_end)
        if growth is not None and growth >= limit_mb:
            out.append(f"{name} RSS grew {growth:.0f} MB after the warm-up (limit {limit_mb:.0f} MB)")
    return out


def rss_growth(series: Sequence[tuple[float, float]], warmup_end: float) -> float | None:
    after = [rss for t, rss in series if t >= warmup_end]
    return after[-1] - after[0] if len(after) >= 2 else None


def held_by_requests(stats: dict[str, Any]) -> int:
    """Locked slots that requests hold: the locked ones less those only session pins hold (an idle server may keep
    an agent's history pinned between its turns; what requests hold it must give back)."""
    return stats["locked_slots"] - stats.get("pinned_slots", 0)


def idle_violations(stats: dict[str, Any]) -> list[str]:
    """Idle: free + evictable + locked + in flight = total, nothing locked by requests or in flight, nothing
    running or waiting."""
    parts = {k: stats.get(k) for k in ("free_slots", "evictable_slots", "locked_slots", "in_flight_slots")}
    if any(v is None for v in parts.values()) or "total_slots" not in stats:
        return [f"the server's stats lack the KV accounting: {sorted(stats)}"]
    out = []
    if sum(parts.values()) != stats["total_slots"]:
        out.append(f"KV identity broken: {parts} does not sum to {stats['total_slots']}")
    if held_by_requests(stats) or parts["in_flight_slots"]:
        out.append(f"slots leaked when idle: {held_by_requests(stats)} locked by requests, "
                   f"{parts['in_flight_slots']} in flight")
    if stats.get("num_running") or stats.get("num_waiting"):
        out.append(f"not idle: {stats.get('num_running')} running, {stats.get('num_waiting')} waiting")
    return out


def log_violations(log: str) -> list[str]:
    """A Python traceback in the server's log, named by the logger line before it and its exception line, and a
    panic of the router (Rust), named by its line."""
    panics = [line.strip()[:200] for line in log.splitlines() if "panicked at" in line]
    found = [f"the router panicked {len(panics)} time(s); the first: {panics[0]!r}"] if panics else []
    if "Traceback" not in log:
        return found
    at = log.index("Traceback")
    head = next((line for line in reversed(log[:at].splitlines()) if "ERROR" in line or "WARNING" in line), "")
    tail = next((line for line in log[at:].splitlines()[1:] if line and not line.startswith(" ")), "")
    return found + [f"the server logged {log.count('Traceback')} traceback(s); the first: {head.strip()[:200]!r} ... "
                    f"{tail.strip()[:200]!r}"]


def summary(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Rows of kind x status: count and latency p50 / max."""
    groups: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for o in outcomes:
        groups[(o.kind, o.status)].append(o.latency_s)
    rows = []
    for (kind, status), lat in sorted(groups.items()):
        lat.sort()
        rows.append({"kind": kind, "status": status, "count": len(lat), "p50_s": lat[len(lat) // 2],
                     "max_s": lat[-1]})
    return rows
