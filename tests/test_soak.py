"""bench/soak.py: its verdict catches each kind of violation (pure checks on made-up records), and its short form
runs clean against a real server: 2 minutes of mixed traffic from every API on model S with a small KV pool."""
from __future__ import annotations

import json

from radixserve.bench import soak, soak_checks
from radixserve.bench.soak_traffic import Outcome


def _o(kind: str, status: str, start: float = 1.0, latency: float = 0.5) -> Outcome:
    return Outcome(kind, status, start, latency)


def test_outcomes_that_break_the_rules_are_named():
    clean = [_o("chat", "200"), _o("malformed", "400"), _o("burst", "429"), _o("hangup", "hangup"), _o("n2", "429"),
             _o("abort", "200"), _o("abort_request", "404"), _o("chat_stream", "200")]
    assert soak_checks.outcome_violations(clean) == []
    bad = clean + [_o("chat", "timeout"), _o("abort", "500"), _o("malformed", "200"), _o("chat_stream", "cut"),
                   _o("burst", "503"), _o("completion", "transport"), _o("chat_stream", "error-event")]
    found = soak_checks.outcome_violations(bad)
    assert found == ["1 abort request(s) ended 500", "1 burst request(s) ended 503",
                     "1 chat request(s) hung past the client deadline", "1 chat_stream request(s) ended cut",
                     "1 chat_stream request(s) ended error-event", "1 completion request(s) ended transport",
                     "1 malformed request(s) ended 200"]


def test_a_kill_window_excuses_errors_but_not_hangs():
    outcomes = [_o("chat", "503", start=10.0), _o("chat_stream", "transport", start=9.0, latency=1.5),
                _o("chat", "timeout", start=11.0), _o("chat", "500", start=5.0)]
    found = soak_checks.outcome_violations(outcomes, kill_windows=[(10.0, float("inf"))])
    assert found == ["1 chat request(s) ended 500", "1 chat request(s) hung past the client deadline"]


def test_rss_growth_counts_from_the_warm_up():
    samples = {"server": [(0.0, 100.0), (30.0, 300.0), (40.0, 310.0), (120.0, 340.0)],
               "engine": [(0.0, 500.0), (30.0, 900.0), (120.0, 960.0)]}
    assert soak_checks.rss_violations(samples, warmup_end=30.0) == [
        "engine RSS grew 60 MB after the warm-up (limit 50 MB)"]
    assert soak_checks.rss_violations(samples, warmup_end=0.0) != []
    assert soak_checks.rss_growth([(0.0, 1.0)], 0.0) is None  # one sample shows no growth


def test_the_idle_state_must_hold_the_kv_identity():
    good = {"total_slots": 100, "free_slots": 60, "evictable_slots": 40, "locked_slots": 0, "in_flight_slots": 0,
            "num_running": 0, "num_waiting": 0}
    assert soak_checks.idle_violations(good) == []
    assert soak_checks.idle_violations({**good, "free_slots": 59}) == [
        "KV identity broken: {'free_slots': 59, 'evictable_slots': 40, 'locked_slots': 0, 'in_flight_slots': 0} "
        "does not sum to 100"]
    leaked = soak_checks.idle_violations({**good, "free_slots": 58, "locked_slots": 2, "num_running": 1})
    assert leaked == ["slots leaked when idle: 2 locked by requests, 0 in flight", "not idle: 1 running, 0 waiting"]
    pinned = {**good, "evictable_slots": 30, "locked_slots": 10, "pinned_slots": 10}  # a session's pin may stay
    assert soak_checks.idle_violations(pinned) == []
    assert soak_checks.idle_violations({**pinned, "pinned_slots": 7}) == [
        "slots leaked when idle: 3 locked by requests, 0 in flight"]
    log = "ok\n2026 ERROR radixserve.frontend: boom\nTraceback (most recent call last):\n  File x\nValueError: bad\n"
    assert soak_checks.log_violations("ok\n") == []
    assert soak_checks.log_violations(log) == [
        "the server logged 1 traceback(s); the first: '2026 ERROR radixserve.frontend: boom' ... 'ValueError: bad'"]
    panic = "router | thread 'tokio-runtime-worker' panicked at src/tree.rs:10:5:\nrouter | index out of bounds\n"
    assert soak_checks.log_violations(panic) == [
        "the router panicked 1 time(s); the first: \"router | thread 'tokio-runtime-worker' panicked at "
        "src/tree.rs:10:5:\""]


def test_the_short_soak_runs_clean_on_model_s(tmp_path):
    code = soak.main(["--model", "S", "--minutes", "2", "--warmup-s", "30", "--concurrency", "12",
                      "--burst-every-s", "40", "--burst-size", "120", "--kv-cache-tokens", "1024",
                      # 120 burst requests at once against room for 16 running + 32 queued: some must get a 429,
                      # however fast the server drains them (with 64 queued, a fast run could admit them all).
                      "--max-queued-requests", "32", "--deadline-s", "60", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "soak_S.json").read_text())
    assert data["violations"] == [] and code == 0, data["violations"]
    kinds = {row["kind"] for row in data["rows"]}
    assert {"chat", "chat_stream", "completion", "generate_ids", "responses", "tool_call", "json_schema", "n2",
            "hangup", "abort", "abort_request", "malformed", "burst"} <= kinds
    assert data["requests"] > 300
    assert {row["status"] for row in data["rows"] if row["kind"] == "burst"} & {"429"}, "no burst passed the queue"
    stats = data["final_stats"]
    assert stats["evictable_slots"] > 0  # only session pins (a Responses chain is a session) hold slots when idle
    assert stats["free_slots"] + stats["evictable_slots"] + stats["pinned_slots"] == stats["total_slots"]
    assert stats["num_evicted_tokens"] > 0 and stats["num_retractions"] > 0  # the pool was small enough
    assert data["rss"]["engine"]["growth_after_warmup_mb"] is not None
