"""Prometheus text exposition for /metrics: engine gauges and counters, latency histograms, and per tenant
(frontend/tenants.py; "default" on a server without keys) its requests, tokens, queue time, KV slots held and 429s.

Latency histograms (the engine's Histogram type, HTTP-side buckets) are fed by each finished
request's GenerateResult as the server sees it.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from ..scheduler.metrics import Histogram

PREFIX = "radixserve_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

# engine.stats() key -> (metric name, type, help)
_ENGINE_METRICS = (
    ("num_running", "num_running_reqs", "gauge", "Requests running in the engine."),
    ("num_waiting", "num_waiting_reqs", "gauge", "Requests waiting in the engine queue."),
    ("total_slots", "kv_slots_total", "gauge", "KV cache slots in the pool."),
    ("free_slots", "kv_slots_free", "gauge", "KV cache slots free."),
    ("evictable_slots", "kv_slots_evictable", "gauge", "KV cache slots held by unlocked cached prefixes."),
    ("locked_slots", "kv_slots_locked", "gauge", "KV cache slots held by prefixes in use."),
    ("pinned_slots", "kv_slots_pinned", "gauge", "KV cache slots only session pins hold (within locked)."),
    ("num_sessions", "sessions_open", "gauge", "Sessions open."),
    ("num_pins_used", "session_pins_used_total", "counter", "Session pins a next turn arrived in time for."),
    ("num_pins_reclaimed", "session_pins_reclaimed_total", "counter", "Session pins dropped for admission."),
    ("num_starts_held", "session_starts_held_total", "counter",
     "Sessions whose first request load control held while the started ones' histories exceeded the pool."),
    ("num_tool_returns", "session_tool_returns_total", "counter",
     "Sessions back after a turn that called a named tool (its return gaps then predict the next return)."),
    ("swap_tokens", "kv_swap_tokens", "gauge", "Tokens of open sessions' histories the swap tier holds on disk."),
    ("swap_restored", "kv_swap_restored_tokens_total", "counter",
     "Prompt tokens read back from the swap tier instead of computed."),
    ("cache_hit_rate", "cache_hit_rate", "gauge", "Cached prompt tokens / prompt tokens since start."),
    ("num_prompt_tokens", "prompt_tokens_total", "counter", "Prompt tokens admitted."),
    ("num_cached_tokens", "cached_tokens_total", "counter", "Prompt tokens served from the radix cache."),
    ("num_generated_tokens", "generation_tokens_total", "counter", "Tokens generated."),
    ("num_evicted_tokens", "evicted_tokens_total", "counter", "Tokens evicted from the radix cache."),
    ("num_requests_finished", "requests_finished_total", "counter", "Requests finished by the engine."),
    ("num_retractions", "retractions_total", "counter", "Requests retracted under KV pressure."),
    ("num_prefix_only_requests", "prefix_only_requests_total", "counter",
     "Prefix-only requests admitted (cache warm-ups and the server's rewritten-history prefetches)."),
    ("num_prefix_only_computed", "prefix_only_computed_tokens_total", "counter",
     "Prompt tokens prefix-only requests computed."),
)


class ServerMetrics:
    """Thread-safe: results arrive on the event loop, renders may come from anywhere."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.finish_reasons: Counter[str] = Counter()
        self.http_responses: Counter[int] = Counter()
        self.tenants: dict[str, Counter[str]] = {}  # tenant -> _TENANT_COUNTERS key -> total
        self.history_rewrites = 0  # chat turns whose history the template renders otherwise (rewrite_prefetch.py)

    def observe_result(self, ttft_s: float | None, e2e_s: float | None, completion_tokens: int,
                       finish_reason: str) -> None:
        with self._lock:
            self.finish_reasons[finish_reason] += 1
            if ttft_s is not None and completion_tokens > 0:
                self.ttft.observe(ttft_s)
            if e2e_s is not None:
                self.e2e.observe(e2e_s)
                if ttft_s is not None and completion_tokens > 1:
                    self.tpot.observe(max(e2e_s - ttft_s, 0.0) / (completion_tokens - 1))

    def observe_tenant(self, tenant: str, result: Any) -> None:
        """A finished engine request (a GenerateResult) of `tenant`."""
        with self._lock:
            totals = self.tenants.setdefault(tenant, Counter())
            totals["requests"] += 1
            totals["prompt_tokens"] += result.prompt_tokens
            totals["cached_tokens"] += result.cached_tokens
            totals["generation_tokens"] += result.completion_tokens
            if result.queue_s is not None:
                totals["queue_time_seconds_sum"] += result.queue_s
                totals["queue_time_seconds_count"] += 1

    def observe_response(self, status: int) -> None:
        with self._lock:
            self.http_responses[status] += 1

    def render(self, stats: dict[str, Any], num_in_flight: int,
               refused: dict[tuple[str, str], int] | None = None) -> str:
        """`refused`: (tenant, limit) -> 429s (TenantLimiter.refused)."""
        lines: list[str] = []
        for key, name, kind, help_text in _ENGINE_METRICS:
            if key in stats and isinstance(stats[key], (int, float)):
                _scalar(lines, name, kind, help_text, stats[key])
        if "total_slots" in stats and "free_slots" in stats:
            _scalar(lines, "kv_slots_used", "gauge", "KV cache slots not free (cached or in use).",
                    stats["total_slots"] - stats["free_slots"])
        _scalar(lines, "http_requests_in_flight", "gauge",
                "Engine requests admitted by the HTTP server and not yet finished.", num_in_flight)
        _scalar(lines, "chat_history_rewrites_total", "counter", "Chat turns whose next rendering differs from "
                "the tokens computed (their canonical history is prefetched when idle).", self.history_rewrites)
        with self._lock:
            _histogram(lines, "time_to_first_token_seconds", "Time to first token.", self.ttft)
            _histogram(lines, "time_per_output_token_seconds", "Time per output token after the first.", self.tpot)
            _histogram(lines, "e2e_request_latency_seconds", "End-to-end request latency.", self.e2e)
            _labelled(lines, "requests_total", "Finished requests by finish reason.", "finish_reason",
                      dict(self.finish_reasons))
            _labelled(lines, "http_responses_total", "HTTP responses by status code.", "code",
                      {str(k): v for k, v in self.http_responses.items()})
            _tenant_lines(lines, self.tenants, stats.get("tenant_slots", {}), refused or {})
        return "\n".join(lines) + "\n"


# Per-tenant series: name suffix -> (type, help); queue time is a summary (its _sum and _count).
_TENANT_COUNTERS = (
    ("requests", "counter", "Engine requests finished, by tenant."),
    ("prompt_tokens", "counter", "Prompt tokens of finished requests, by tenant."),
    ("cached_tokens", "counter", "Prompt tokens served from the radix cache, by tenant."),
    ("generation_tokens", "counter", "Tokens generated, by tenant."),
)


def _tenant_lines(lines: list[str], totals: dict[str, Counter[str]], slots: dict[str, int],
                  refused: dict[tuple[str, str], int]) -> None:
    for key, kind, help_text in _TENANT_COUNTERS:
        full = f"{PREFIX}tenant_{key}_total"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        lines += [f'{full}{{tenant="{_label(t)}"}} {totals[t][key]}' for t in sorted(totals)]
    full = PREFIX + "tenant_queue_time_seconds"
    lines += [f"# HELP {full} Time from arrival to first admission in the engine, by tenant.",
              f"# TYPE {full} summary"]
    for t in sorted(totals):
        lines.append(f'{full}_sum{{tenant="{_label(t)}"}} {_fmt(totals[t]["queue_time_seconds_sum"])}')
        lines.append(f'{full}_count{{tenant="{_label(t)}"}} {totals[t]["queue_time_seconds_count"]}')
    full = PREFIX + "tenant_kv_slots"
    lines += [f"# HELP {full} KV cache slots held by the tenant's running requests.", f"# TYPE {full} gauge"]
    lines += [f'{full}{{tenant="{_label(t)}"}} {slots[t]}' for t in sorted(slots)]
    full = PREFIX + "tenant_rate_limited_total"
    lines += [f"# HELP {full} Requests refused (429) for a tenant limit, by tenant and limit.",
              f"# TYPE {full} counter"]
    lines += [f'{full}{{tenant="{_label(t)}",limit="{limit}"}} {n}' for (t, limit), n in sorted(refused.items())]


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _scalar(lines: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    full = PREFIX + name
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full} {_fmt(value)}"]


def _histogram(lines: list[str], name: str, help_text: str, hist: Histogram) -> None:
    full = PREFIX + name
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
    cumulative = 0
    for bound, count in zip(hist.buckets, hist.counts):
        cumulative += count
        lines.append(f'{full}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
    lines.append(f'{full}_bucket{{le="+Inf"}} {hist.count}')
    lines.append(f"{full}_sum {_fmt(hist.total)}")
    lines.append(f"{full}_count {hist.count}")


def _labelled(lines: list[str], name: str, help_text: str, label: str, values: dict[str, int]) -> None:
    full = PREFIX + name
    lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
    for key in sorted(values):
        lines.append(f'{full}{{{label}="{key}"}} {values[key]}')


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
