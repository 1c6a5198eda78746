"""bench/responses_bench.py end to end on the tiny bench model (2 agents x 3 turns, one round): both modes run,
the report adds up, and the stored conversations hit the cache at least as well as the resent history."""
from radixserve.bench import responses_bench


def test_responses_bench_runs_both_modes(tmp_path):
    out = str(tmp_path / "responses_bench_tiny")
    report = responses_bench.main(["--model", "tiny", "--agents", "2", "--turns", "3", "--output-tokens", "8",
                                   "--instruction-words", "40", "--words-per-turn", "8", "--runs", "1",
                                   "--threads", "1", "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"responses", "chat"}
    for run in report["runs"]:
        assert run["requests"] == 6 and 0 <= run["cached_tokens"] <= run["prompt_tokens"]
    assert rows["responses"]["hit_rate"] >= rows["chat"]["hit_rate"] > 0
    assert "responses / chat req/s" in open(out + ".md").read()
