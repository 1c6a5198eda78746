"""The bench commands run end to end on tiny settings and write what they promise."""
import json

from radixserve.bench import run_cache_bench, run_prefix_bench


def test_prefix_bench_writes_json_and_markdown(tmp_path):
    report = run_prefix_bench.main(["--size", "tiny", "--model", "tiny", "--runs", "1", "--out", str(tmp_path)])
    on, off = report["cache_on"], report["cache_off"]
    assert off["cached_tokens"] == 0 and off["computed_tokens"] == off["prompt_tokens"]
    assert on["computed_tokens"] < off["computed_tokens"]
    assert 0.95 <= on["hit_rate_vs_optimal"] <= 1.0 + 1e-9
    saved = json.loads((tmp_path / "prefix_bench.json").read_text())
    assert saved["checks"]["hit_rate_vs_optimal_ok"] is True
    assert "| cache off |" in (tmp_path / "prefix_bench.md").read_text()


def test_cache_bench_grid_writes_json_markdown_and_png(tmp_path):
    report = run_cache_bench.main(["--size", "tiny", "--workloads", "gsp,tot", "--policies", "fcfs,cache-aware",
                                   "--budgets", "0.5,1.0", "--skip", "eviction,starve,overhead,speed",
                                   "--out", str(tmp_path)])
    assert len(report["grid"]) == 2 * 2 * 2
    for row in report["grid"]:
        assert 0.0 <= row["hit_rate"] <= row["optimal_hit_rate"] + 1e-9
    assert set(report["checks"]["vs_optimal_at_100"]) == {"gsp", "tot"}
    assert (tmp_path / "cache_bench.png").stat().st_size > 1000
    assert "| gsp |" in (tmp_path / "cache_bench.md").read_text()
