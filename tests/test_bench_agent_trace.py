"""bench/agent_trace.py: seeded agent plans, the recompute accounting, and a tiny run with sessions on and off."""
import json

from radixserve.bench import agent_trace
from radixserve.bench.agent_trace import TraceConfig, TurnRecord, make_plan, summarize

TINY = ["--model", "tiny", "--agents", "6", "--apps", "2", "--app-tokens", "96", "--user-tokens", "16", "--turns",
        "3", "--call-tokens", "8", "--answer-tokens", "8", "--tool-tokens", "16", "32", "--arrivals-per-s", "20",
        "--tool-median-s", "0.2", "--tool-p95-s", "1", "--vocab", "500", "--budgets", "0.5", "--repeats", "1"]


def test_plans_are_seeded_and_shaped_as_asked():
    cfg = TraceConfig(agents=5, apps=2, app_tokens=40, turns=3, tool_tokens=(10, 20), seed=3)
    apps, agents = make_plan(cfg)
    assert (apps, agents) == make_plan(cfg) and make_plan(TraceConfig(seed=4, agents=5))[1] != agents
    assert [len(a) for a in apps] == [40, 40] and [a.app for a in agents] == [0, 1, 0, 1, 0]
    assert all(len(a.tool_results) == len(a.waits_s) == 2 for a in agents)
    assert all(10 <= len(t) <= 20 for a in agents for t in a.tool_results)
    assert all(x < y for x, y in zip([a.arrival_s for a in agents], [a.arrival_s for a in agents][1:]))
    assert cfg.upper_bound() == 2 * 40 + 5 * (64 + 2 * (32 + 20) + 64)


def test_the_peak_working_set_counts_live_histories_and_their_apps():
    cfg = TraceConfig(agents=2, apps=2, turns=2, app_tokens=10)
    app = [1] * 10
    # agent 0 (app 0): turn 0 sent at 0 (prompt 10 + 4), done at 1 (+3 out); turn 1 sent at 5 (+3 + 6 tool), done 6.
    # agent 1 (app 1): turn 0 sent at 2 (10 + 5), done at 3 (+2); turn 1 sent at 5.5 (+2 + 9), done at 7 (+5).
    records = [TurnRecord(0, 0, 14, 0, 14, 1.0, 0.0, app + [2] * 4, [3] * 3),
               TurnRecord(0, 1, 23, 0, 7, 1.0, 5.0, app + [2] * 13, [3] * 5),
               TurnRecord(1, 0, 15, 0, 15, 1.0, 2.0, app + [2] * 5, [3] * 2),
               TurnRecord(1, 1, 26, 0, 10, 1.5, 5.5, app + [2] * 16, [3] * 5)]
    # At 5.5 agent 0 runs its last turn (13 own tokens) and agent 1 sends 16: 13 + 16 + both apps (20) = 49; at 6
    # agent 0 finishes (13 + 5 = 18) beside 16: 54, the peak; then agent 0 is gone: 21 + 10 at 7.
    assert agent_trace.peak_working_set(records, cfg) == 54
    # One turn each, over by the time the other starts: never alive together, the larger alone counts.
    assert agent_trace.peak_working_set(records[:1] + records[2:3], cfg) == 7 + 10


def test_excess_is_recompute_beyond_the_cold_tokens():
    records = [TurnRecord(0, 0, 100, 0, 100, 0.1, 0.0, [], []), TurnRecord(0, 1, 150, 90, 41, 0.2, 1.0, [], []),
               TurnRecord(1, 0, 100, 60, 40, 0.1, 0.5, [], [])]
    row = summarize(records, [1.0, 2.0], 4.0, {"num_pins_used": 1})
    assert row["recomputed"] == 350 - 150 and row["cold"] == 181 and row["excess"] == 200 - 181
    assert row["turns"] == 3 and row["turns_per_s"] == 0.75 and row["pins"]["num_pins_used"] == 1


def test_a_tiny_trace_runs_with_sessions_on_and_off(tmp_path):
    report = agent_trace.main([*TINY, "--out", str(tmp_path)])
    on, off = sorted(report["rows"], key=lambda r: not r["sessions"])
    for row in (on, off):
        assert row["turns"] == 6 * 3 and row["recomputed"] == row["prompt_tokens"] - row["cached_tokens"] > 0
    assert on["pins"]["num_pins_pinned"] > 0 and off["pins"]["num_pins_pinned"] == 0
    for row in (on, off):  # the yardsticks recompute at least the cold tokens (the same definition of first-time)
        assert row["sim"]["lru"] >= 0 and row["sim"]["belady"] >= 0
        assert 0 < row["busy"] < 1  # the engine stepped for part of the run, and idled while the tools ran
        assert row["busy_arrivals"] >= 0  # (its window, ~0.3 s here, is too short to bound: a step counts whole)
    saved = json.loads((tmp_path / "agent_trace_tiny.json").read_text())
    assert len(saved["rows"]) == 2 and f"| 0.5 ({on['kv_tokens']}) | on |" in (tmp_path / "agent_trace_tiny.md").read_text()
    assert (tmp_path / "agent_trace_tiny.png").stat().st_size > 10_000  # recompute and p99 against the budget


def test_rows_are_medians_over_the_repetitions():
    def run(rep, sessions, excess, used):
        return {"rep": rep, "budget": 0.5, "kv_tokens": 100, "sessions": sessions, "excess": excess,
                "turn_p99_s": 0.1 * excess, "pins": {"num_pins_used": used}, "sim": {"lru": 2 * excess},
                "busy": 0.01 * excess}
    runs = [run(0, True, 5, 3), run(0, False, 9, 0), run(1, False, 7, 0), run(1, True, 1, 5), run(2, True, 3, 4),
            run(2, False, 8, 0)]
    on, off = agent_trace.medians(runs)
    assert on["sessions"] and on["excess"] == 3 and on["pins"]["num_pins_used"] == 4 and on["kv_tokens"] == 100
    assert not off["sessions"] and off["excess"] == 8 and off["turn_p99_s"] == 0.8 and off["sim"]["lru"] == 16
