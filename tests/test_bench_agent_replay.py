"""bench/agent_replay.py: agent_trace's trace against an in-process engine on a virtual clock, counted."""
import dataclasses
import json
import time

import pytest

from radixserve.bench import agent_replay
from radixserve.bench.agent_replay import StepModel, counts, run, seed_rows
from radixserve.bench.agent_plan import TraceConfig, make_plan
from radixserve.bench.harness import bench_model_path

CFG = TraceConfig(agents=6, apps=2, app_tokens=96, user_tokens=16, turns=3, call_tokens=8, answer_tokens=8,
                  tool_tokens=(16, 32), arrivals_per_s=20, tool_median_s=0.2, tool_p95_s=1.0, vocab=500, seed=1)


@pytest.fixture(scope="module")
def model():
    return bench_model_path("tiny")


def test_a_run_is_counted_on_the_virtual_clock(model):
    step = StepModel(base_s=0.01, per_token_s=0.0)
    out = run(model, CFG, 240, True, step)
    records = out["records"]
    assert len(records) == 6 * 3 and out["kv_tokens"] == 240
    for r in records:  # whole steps of 10 ms: at least one per output token
        assert r.latency_s == pytest.approx(round(r.latency_s / 0.01) * 0.01) and r.latency_s >= 8 * 0.01 - 1e-9
        assert 0 <= r.queue_s <= r.latency_s
    by_agent = {}
    for r in sorted(records, key=lambda r: r.sent_s):
        by_agent.setdefault(r.agent, []).append(r)
    for turns in by_agent.values():  # the next turn is sent once the tool's trace latency has passed
        assert [t.turn for t in turns] == [0, 1, 2]
        assert all(b.sent_s >= a.sent_s + a.latency_s for a, b in zip(turns, turns[1:]))
        assert turns[1].prompt_ids[:len(turns[0].prompt_ids) + 8] == turns[0].prompt_ids + turns[0].output_ids
    assert out["pins"]["num_pins_pinned"] > 0


def test_wall_steps_advance_the_clock_by_the_measured_step_time(model):
    """--wall-steps: the clock moves by each step's wall time, not the model's cost (10 s a step here, which would
    put the run's busy time far beyond its wall time)."""
    started = time.perf_counter()
    out = run(model, CFG, 240, True, StepModel(base_s=10.0, per_token_s=0.0, wall=True))
    elapsed = time.perf_counter() - started
    assert len(out["records"]) == 6 * 3 and 0 < out["busy_s"] <= elapsed
    assert all(0 < r.latency_s < elapsed for r in out["records"])


def test_named_tools_reach_the_engine_and_the_records(model):
    """As a chat client's tool calls would: each returning turn's tool is named to the engine, which counts every
    return after one; the records carry it for the online yardstick. Unnamed, neither sees a tool."""
    cfg = dataclasses.replace(CFG, tools=3)
    plans = make_plan(cfg)[1]
    named, unnamed = run(model, cfg, 240, True, name_tools=True), run(model, cfg, 240, True)
    assert named["pins"]["num_tool_returns"] == 6 * 2 and unnamed["pins"]["num_tool_returns"] == 0
    for r in named["records"]:
        assert r.tool == (plans[r.agent].tools[r.turn] if r.turn < 2 else None)
    assert {r.tool for r in unnamed["records"]} == {None}


def test_runs_are_deterministic_counts(model):
    first, second = (counts(run(model, CFG, 240, True)) for _ in range(2))
    assert first == second and first["excess"] > 0  # 240 slots cannot hold two apps and six histories


def test_seed_rows_compare_sessions_with_the_yardsticks(model, capsys, tmp_path):
    (full,) = seed_rows(model, CFG, [1.0], StepModel())
    assert full["kv_tokens"] >= full["peak"] and full["on"]["excess"] <= full["off"]["excess"]
    assert full["target"] == pytest.approx(full["on"]["belady_sim"] + 0.25 * (full["off"]["excess"]
                                                                             - full["on"]["belady_sim"]))
    rows = agent_replay.main(["--model", "tiny", "--seeds", "1", "--budgets", "0.5", "--agents", "6",
                              "--arrivals-per-s", "20", "--config", '{"apps": 2, "app_tokens": 96, "user_tokens": 16,'
                              ' "turns": 3, "call_tokens": 8, "answer_tokens": 8, "tool_tokens": [16, 32],'
                              ' "tool_median_s": 0.2, "tool_p95_s": 1.0, "vocab": 500}', "--out", str(tmp_path)])
    on = rows[0]["on"]
    assert len(rows) == 1 and on["lru_sim"] >= on["belady_sim"] >= 0 <= on["online_sim"]
    assert "seed 1 budget 0.5" in capsys.readouterr().out
    assert json.loads((tmp_path / "agent_replay.json").read_text())["rows"] == json.loads(json.dumps(rows))
    assert f"| 1 | 0.5 ({rows[0]['kv_tokens']}) | {on['excess']} |" in (tmp_path / "agent_replay.md").read_text()
    report = (tmp_path / "agent_replay.md").read_text()
    assert f"Budget 0.5: met on {int(rows[0]['meets'])} of 1 seeds; on the medians excess on {on['excess']:,}," in report


def test_merge_writes_one_report_of_runs_split_by_seed(tmp_path):
    """Seeds run in parallel processes, each writing its own JSON: --merge reports them as one run."""
    def row(seed, on, off, belady):
        side = {"excess": on, "lru_sim": off + 10, "online_sim": on, "belady_sim": belady, "turn_p99_s": 1.0,
                "busy_arrivals": 0.8}
        return {"seed": seed, "budget": 0.5, "kv_tokens": 100, "on": side,
                "off": {**side, "excess": off, "turn_p99_s": 2.0}, "target": belady + 0.25 * (off - belady),
                "meets": on <= belady + 0.25 * (off - belady)}

    for name, rows in (("a", [row(1, 50, 100, 40), row(0, 90, 100, 60)]), ("b", [row(2, 70, 100, 40)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "agent_replay.json").write_text(json.dumps({"rows": rows}))
    merged = agent_replay.main(["--merge", str(tmp_path / "a" / "agent_replay.json"),
                                str(tmp_path / "b" / "agent_replay.json"), "--out", str(tmp_path / "all")])
    assert [r["seed"] for r in merged] == [0, 1, 2]
    report = (tmp_path / "all" / "agent_replay.md").read_text()
    assert "| 1 | 0.5 (100) | 50 | 100 | 110 | 50 | 40 | 55 (met) | 83% | 86% | 1.0 / 2.0 | 80% |" in report
    # medians: on 70, off 100, Bélády 40: target 55, missed, (100 - 70) / (100 - 40) closed
    assert ("Budget 0.5: met on 1 of 3 seeds; on the medians excess on 70, off 100, Bélády 40, target 55 (missed; "
            "closed 50%); turn p99 on / off 0.50x") in report


@pytest.mark.parametrize("named", [True, False])
def test_warm_gaps_are_another_trace_of_the_same_workload(named):
    """--warm-gaps: the engine starts with what a server that served this workload before observed, each return
    under its tool when named: the tool latencies of the same config's plan at another seed, not this run's."""
    from radixserve.scheduler.return_gaps import MIN_OWN, ToolGaps

    cfg = dataclasses.replace(CFG, tools=3, agents=24)
    gaps = ToolGaps()
    agent_replay.warm_gaps(gaps, cfg, named)
    other = make_plan(dataclasses.replace(cfg, seed=cfg.seed + agent_replay.WARM_SEED_OFFSET))[1]
    waits = sorted(w for p in other for w in p.waits_s[:cfg.turns - 1])
    assert len(gaps.all) == len(waits) == 24 * 2 and gaps.named == 48 * named
    assert gaps.all.within(waits[11]) == pytest.approx(12 / 48)
    for k in range(3):
        mine = [w for p in other for w, t in zip(p.waits_s, p.tools) if t == k]
        assert len(mine) >= MIN_OWN
        seen = gaps.of(agent_replay.tool_name(k))
        assert len(seen) == (len(mine) if named else 48)
        assert seen.remaining(0.0) == pytest.approx(sum(mine) / len(mine) if named else sum(waits) / 48)
    assert sorted(w for p in make_plan(cfg)[1] for w in p.waits_s[:cfg.turns - 1]) != waits
