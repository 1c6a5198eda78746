"""bench/agent_chat.py: the demo model's weather agents over chat completions, sessions on and off, beside churn."""
import json

from radixserve.bench import agent_chat
from radixserve.bench.agent_chat import summarize

TINY = ["--agents", "4", "--arrivals-per-s", "8", "--tool-median-s", "0.5", "--tool-p95-s", "1.5", "--fillers", "2",
        "--repeats", "1"]


def test_summary_counts_the_second_turns_only():
    records = [{"agent": 0, "finish": "tool_calls", "prompt": 200, "cached": 180, "latency_s": 0.1, "answer": "stop"},
               {"agent": 1, "finish": "stop"}]
    row = summarize(records, 7, {"num_pins_used": 1})
    assert (row["agents"], row["tool_calls"], row["answers"]) == (2, 1, 1)
    assert row["second_hit"] == 0.9 and row["filler_requests"] == 7 and row["pins"] == {"num_pins_used": 1}


def test_pinned_histories_survive_the_churn(tmp_path):
    report = agent_chat.main([*TINY, "--out", str(tmp_path)])
    on, off = sorted(report["rows"], key=lambda r: not r["sessions"])
    for row in (on, off):  # the demo model calls the tool, then answers from its result
        assert row["tool_calls"] == row["answers"] == 4 and row["filler_requests"] > 0
    # Sessions on: each first turn ends in a tool call, the history is pinned and its continuation hits it whole
    # (all but the tool message and the new turn's header).
    assert on["pins"]["num_pins_used"] == 4 and on["second_hit"] > 0.8
    # The server saw each tool call's name (get_weather) and the agent's return after it.
    assert on["pins"]["num_tool_returns"] == 4
    assert off["pins"]["num_pins_pinned"] == off["pins"]["num_tool_returns"] == 0
    saved = json.loads((tmp_path / "agent_chat_demo.json").read_text())
    assert saved["rows"] == report["rows"]
