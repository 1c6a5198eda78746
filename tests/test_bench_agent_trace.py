"""bench/agent_trace.py: seeded agent plans, the recompute accounting, and a tiny run with sessions on and off."""
import json
import statistics

from radixserve.bench import agent_trace
from radixserve.bench.agent_plan import TraceConfig, TurnRecord, make_plan, queued_share, tail_turns
from radixserve.bench.agent_trace import summarize
from radixserve.bench.cache_sim import POLICIES
from radixserve.bench.harness import bench_model_path
from radixserve.bench.kv_memory import kv_shape, pool_tokens
from radixserve.frontend.cli import build_parser
from radixserve.frontend.flags import config_from_args

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


def test_several_tools_keep_the_trace_and_split_its_latencies():
    """Each turn calls one of `tools` tools, each with its own latency (their medians in order); the tokens and
    arrivals are the seed's whatever the tools (their draws have a stream of their own), and one tool is the
    trace's single lognormal."""
    one, four = TraceConfig(agents=400, seed=2), TraceConfig(agents=400, seed=2, tools=4)
    (apps1, plans1), (apps4, plans4) = make_plan(one), make_plan(four)
    assert apps1 == apps4 and [(a.arrival_s, a.user, a.tool_results) for a in plans1] == \
        [(a.arrival_s, a.user, a.tool_results) for a in plans4]
    assert {t for a in plans1 for t in a.tools} == {0} and {t for a in plans4 for t in a.tools} == {0, 1, 2, 3}
    medians = [statistics.median(w for a in plans4 for w, t in zip(a.waits_s, a.tools) if t == k) for k in range(4)]
    assert medians == sorted(medians) and medians[3] > 10 * medians[0]
    everyone = sorted(w for a in plans4 for w in a.waits_s)
    assert 0.7 < statistics.median(everyone) < 1.4 and 6 < everyone[int(0.95 * len(everyone))] < 14


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


def test_the_tail_is_the_slowest_percent_of_turns_with_their_queued_time():
    # 200 turns: latency i / 100 s, queued half of it, except the slowest, queued 0.9 of it; 3 uncached tokens each.
    records = [TurnRecord(i % 7, i % 4, 10, 7, 3, i / 100, float(i), [], [], (0.9 if i == 199 else 0.5) * i / 100)
               for i in range(200)]
    tail = tail_turns(records[::-1])  # any order in, slowest first out
    assert [t["latency_s"] for t in tail] == [1.99, 1.98]  # 1% of 200 turns: the two slowest
    assert tail[0] == {"agent": 199 % 7, "turn": 199 % 4, "latency_s": 1.99, "queue_s": 0.9 * 1.99, "uncached": 3}
    assert abs(queued_share(tail) - (0.9 * 1.99 + 0.5 * 1.98) / (1.99 + 1.98)) < 1e-12
    assert tail_turns(records[:10]) == tail_turns(records[9:10])  # under 100 turns: the slowest alone
    assert len(tail_turns(records[:192])) == 2  # 1.92 rounds up
    unreported = [TurnRecord(0, 0, 10, 7, 3, 1.0, 0.0, [], [])]  # a peer's server reports no queue time
    assert queued_share(tail_turns(unreported)) is None and tail_turns([]) == []
    row = summarize(records, [1.0], 10.0, {})
    assert row["tail"] == tail and row["tail_queued"] == queued_share(tail)


def test_a_tiny_trace_runs_with_sessions_on_and_off(tmp_path):
    report = agent_trace.main([*TINY, "--out", str(tmp_path)])
    on, off = sorted(report["rows"], key=lambda r: not r["sessions"])
    for row in (on, off):
        assert row["turns"] == 6 * 3 and row["recomputed"] == row["prompt_tokens"] - row["cached_tokens"] > 0
    assert on["pins"]["num_pins_pinned"] > 0 and off["pins"]["num_pins_pinned"] == 0
    for row in (on, off):  # the yardsticks recompute at least the cold tokens (the same definition of first-time)
        assert min(row["sim"][policy] for policy in ("lru", "online", "belady")) >= 0
        assert 0 < row["busy"] < 1  # the engine stepped for part of the run, and idled while the tools ran
        assert row["busy_arrivals"] >= 0  # (its window, ~0.3 s here, is too short to bound: a step counts whole)
    saved = json.loads((tmp_path / "agent_trace_tiny.json").read_text())
    table = (tmp_path / "agent_trace_tiny.md").read_text()
    assert len(saved["rows"]) == 2 and f"| auto | {on['kv_tokens']} | on |" in table
    assert on["pool_slots"] == off["pool_slots"] == on["kv_tokens"]
    assert (tmp_path / "agent_trace_tiny.png").stat().st_size > 10_000  # recompute and p99 against the budget
    for run in saved["runs"]:  # the server reports each turn's time queued: the slowest turns say how much
        assert run["tail"] and 0 <= run["tail_queued"] <= 1 and "tail" not in saved["rows"][0]
        assert run["tail"][0]["latency_s"] == max(t["latency_s"] for t in run["tail"]) >= run["turn_p99_s"]
    assert f"0.5 auto on: {on['tail_queued']:.0%}" in table


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


# -- KV dtypes at equal memory (--kv-cache-dtypes) ----------------------------------------------

L_SHAPE = (24, 2, 64, 2)  # bench model L: 24 layers, 2 kv heads of 64, bf16


def test_each_kv_dtype_gets_the_tokens_the_same_bytes_hold():
    # bf16: 2 (K, V) x 24 x 2 x 64 x 2 = 12288 bytes a token; int8: 2 x 24 x 2 x (64 + a 4-byte scale) = 6528.
    assert pool_tokens(1000, L_SHAPE, "auto") == 1000
    assert pool_tokens(1000, L_SHAPE, "int8") == 1000 * 12288 // 6528 == 1882
    assert 1882 * 6528 <= 1000 * 12288 < 1883 * 6528  # the most int8 tokens within the bf16 pool's bytes
    assert pool_tokens(1000, (24, 2, 64, 4), "int8") == 1000 * 24576 // 6528 == 3764  # an fp32 model's pool


def test_the_kv_shape_is_the_dtype_the_server_runs_in():
    path = bench_model_path("tiny")  # fp32 weights, 2 layers, 2 kv heads of 64 / 4 = 16
    assert kv_shape(path, "auto") == (2, 2, 16, 4) and kv_shape(path, "bfloat16") == (2, 2, 16, 2)


def test_run_budget_asks_for_load_control_with_sessions_on_only(monkeypatch):
    started = []

    class Server:
        url = "http://127.0.0.1:1"

        def __init__(self, args, env=None):
            started.append(args)

        def stop(self):
            pass

    async def no_trace(url, cfg, sessions, kv_tokens):
        return {}

    import radixserve.frontend.spawn as spawn
    monkeypatch.setattr(spawn, "ServerProcess", Server)
    monkeypatch.setattr(agent_trace, "run_trace", no_trace)
    cfg = TraceConfig(agents=2)
    for sessions in (True, False):
        agent_trace.run_budget("m", cfg, 100, sessions, 1, admission_ratio=1.5)
    agent_trace.run_budget("m", cfg, 100, True, 1)
    agent_trace.run_budget("m", cfg, 100, True, 1, admission_ratio=0.0)
    on, off, default, zero = started
    assert on[on.index("--session-admission-ratio") + 1] == "1.5" and "--disable-agent-cache" not in on
    assert "--session-admission-ratio" not in off and "--disable-agent-cache" in off
    assert "--session-admission-ratio" not in default
    assert zero[zero.index("--session-admission-ratio") + 1] == "0.0"  # 0: off, not the server's default


def test_server_args_carry_the_kv_dtype_and_tokens_to_the_server():
    args = agent_trace.server_args("/ckpt", TraceConfig(agents=6), 1882, 1, "bfloat16", "int8")
    engine = config_from_args(build_parser().parse_args(["serve", *args])).engine
    assert (engine.kv_cache_dtype, engine.kv_cache_tokens, engine.dtype) == ("int8", 1882, "bfloat16")
    assert engine.model_path == "/ckpt" and engine.num_threads == 1


def _fake_row(peak: int) -> dict:
    records = [TurnRecord(0, 0, 100, 40, 50, 0.1, 0.0, [], [])]
    sim = {f"{p}{s}": 0 for p in POLICIES for s in ("", "_overflow", "_deferred")}
    return summarize(records, [1.0], 2.0, {}) | {"busy": 0.5, "busy_arrivals": 0.5, "peak_tokens": peak, "sim": sim}


def test_the_cli_runs_each_kv_dtype_at_one_budget_memory(tmp_path, monkeypatch):
    calls = []

    def run_budget(path, cfg, kv_tokens, sessions, threads, dtype="auto", kv_cache_dtype="auto", env=None,
                   admission_ratio=None, swap_space=0.0):
        calls.append((kv_tokens, sessions, dtype, kv_cache_dtype))
        ratios.append(admission_ratio)
        swaps.append(swap_space)
        return _fake_row(4000)

    ratios, swaps = [], []

    monkeypatch.setattr(agent_trace, "run_budget", run_budget)
    report = agent_trace.main([*TINY, "--repeats", "2", "--kv-cache-dtypes", "auto,int8", "--sessions", "on",
                               "--session-admission-ratio", "1.5", "--kv-swap-space", "2", "--out", str(tmp_path)])
    auto = 2000  # 0.5 of the fake peak, above the floor (one longest request)
    int8 = pool_tokens(auto, (2, 2, 16, 4), "int8")
    assert int8 == 2000 * 512 // 160 == 6400  # tiny runs in fp32: 2 x 2 x 2 x 16 x 4 bytes a token against 16 + 4
    calibrate = TraceConfig(agents=6, apps=2, app_tokens=96, user_tokens=16, turns=3, call_tokens=8,
                            answer_tokens=8, tool_tokens=(16, 32)).upper_bound()
    assert calls == [(calibrate, False, "auto", "auto"), (auto, True, "auto", "auto"), (int8, True, "auto", "int8"),
                     (calibrate, False, "auto", "auto"), (int8, True, "auto", "int8"), (auto, True, "auto", "auto")]
    assert ratios == [None, 1.5, 1.5, None, 1.5, 1.5]  # load control for the measured runs, not the calibrations
    assert swaps == [0.0, 2.0, 2.0, 0.0, 2.0, 2.0]  # and so the swap tier
    assert [(r["kv_cache_dtype"], r["kv_tokens"], r["sessions"]) for r in report["rows"]] == [
        ("auto", auto, True), ("int8", int8, True)]
    assert report["rows"][0]["kv_bytes"] == report["rows"][1]["kv_bytes"] == auto * 512
    text = (tmp_path / "agent_trace_tiny.md").read_text()
    assert f"| 0.5 ({auto * 512 / 2**20:.3g}) | int8 | {int8} | on |" in text and "| auto | 2000 | on |" in text
    assert "swap tier holds up to 2 GiB on disk" in text


def test_a_tiny_trace_runs_with_an_int8_kv_cache(tmp_path):
    report = agent_trace.main([*TINY, "--kv-cache-dtypes", "int8", "--sessions", "on", "--kv-swap-space", "0.01",
                               "--out", str(tmp_path)])
    (row,) = report["rows"]
    assert row["kv_cache_dtype"] == "int8" and row["pool_slots"] == row["kv_tokens"]  # the server's own pool
    assert row["turns"] == 6 * 3 and row["pins"]["num_pins_pinned"] > 0
    assert row["pins"]["swap_bytes_per_token"] > 0  # the server took --kv-swap-space and runs the tier
