"""bench/router_bench.py without four workers: the text gsp workload, the token accounting over the
workers' counters, the summary and the JSON + Markdown report (the real run: bench/results/router_bench_S)."""
from __future__ import annotations

import json

import pytest
from radixserve.bench.output import BenchOutput

from radixserve.bench.router_bench import (
    SIDES, build_report, computed_tokens, markdown, summarize, text_gsp, write_report)


def test_text_gsp_groups_share_one_system_prompt_in_a_seeded_shuffled_order():
    reqs = text_gsp(num_groups=4, per_group=3, system_words=20, question_words=4, output_len=5, seed=7)
    assert len(reqs) == 12 and text_gsp(4, 3, 20, 4, 5, seed=7) == reqs
    assert text_gsp(4, 3, 20, 4, 5, seed=8) != reqs
    systems = {}
    for r in reqs:
        systems.setdefault(r.group, set()).add(r.system)
        assert len(r.question.split()) == 4 and r.max_tokens == 5
    assert all(len(s) == 1 for s in systems.values()) and len({next(iter(s)) for s in systems.values()}) == 4
    assert all(len(next(iter(s)).split()) == 20 + 2 for s in systems.values())  # "group g:" + 20 words
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # shuffled, not group by group
    body = reqs[0].body("m")
    assert body["stream"] and body["messages"][0] == {"role": "system", "content": reqs[0].system}
    assert "stream" not in reqs[0].body("m", stream=False)


def test_computed_tokens_sums_the_workers_deltas():
    before = [{"num_prompt_tokens": 100, "num_cached_tokens": 10}, {"num_prompt_tokens": 0, "num_cached_tokens": 0}]
    after = [{"num_prompt_tokens": 300, "num_cached_tokens": 110}, {"num_prompt_tokens": 50, "num_cached_tokens": 5}]
    assert computed_tokens(before, after) == {"prompt_tokens": 250, "cached_tokens": 105, "computed_tokens": 145}


def _row(side: str, computed: int) -> dict:
    timings = [{"ttft_s": 0.1, "latency_s": 0.5}, {"ttft_s": 0.3, "latency_s": 0.7}, {"ttft_s": None, "latency_s": 1}]
    return summarize(side, timings, 2.0, {"prompt_tokens": 1000, "cached_tokens": 1000 - computed,
                                          "computed_tokens": computed})


def test_summary_and_report(tmp_path):
    rows = [_row("single", 200), _row("cache_aware", 210), _row("round_robin", 400)]
    assert [r["side"] for r in rows] == list(SIDES)
    assert rows[0]["req_per_s"] == 1.5 and rows[0]["hit_rate"] == 0.8
    assert rows[0]["ttft_p50_s"] == pytest.approx(0.2) and rows[0]["ttft_p99_s"] == pytest.approx(0.298)
    config = {"command": "python -m radixserve.bench.router_bench", "model": "S", "replicas": 4,
              "router_version": "0.3.2", "concurrency": 8, "note": "honest note",
              "workload": {"num_groups": 16, "per_group": 8, "system_words": 300, "question_words": 12,
                           "output_len": 32}, "machine": {"cpus": 2}}
    report = build_report(rows, config)
    assert [r["computed_vs_single"] for r in report["sides"]] == [1.0, 1.05, 2.0]
    text = markdown(report)
    assert "| single | 1 | 80.0% | 200 | 1.00x | 1.50 | 200 / 298 |" in text
    assert "| round_robin | 4 | 60.0% | 400 | 2.00x |" in text and "honest note" in text
    assert write_report(report, BenchOutput("router_bench", str(tmp_path))) == text
    assert json.loads((tmp_path / "router_bench_S.json").read_text())["sides"][2]["computed_tokens"] == 400
    assert (tmp_path / "router_bench_S.md").read_text() == text
