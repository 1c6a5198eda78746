"""bench/sample_bench.py runs end to end on a small vocabulary and writes what it promises."""
import json
import subprocess
from pathlib import Path

import pytest

from radixserve.bench import sample_bench

REPO = Path(sample_bench.__file__).resolve().parents[1]


def test_sample_bench_writes_json_and_markdown(tmp_path):
    report = sample_bench.main(["--vocab", "512", "--batches", "1,3", "--repeats", "2", "--threads", "1",
                                "--out", str(tmp_path)])
    cells = {(r["mode"], r["batch"], r["dtype"]) for r in report["rows"]}
    assert cells == {(m, b, d) for m in sample_bench.MODES for b in (1, 3) for d in ("float32", "bfloat16")}
    assert all(r["after"]["min_ms"] <= r["after"]["median_ms"] for r in report["rows"])
    assert json.loads((tmp_path / "sample_bench.json").read_text()) == report
    md = (tmp_path / "sample_bench.md").read_text()
    assert "| sample_rep | 3 | bfloat16 |" in md and "vocab 512" in md


def test_a_baseline_of_this_tree_draws_the_same_tokens(tmp_path):
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout: --baseline reads the sampler from git")
    loaded = [f"kernels/{name}.py" for name in sample_bench._OLD_MODULES]
    if subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", *loaded]).returncode != 0:
        pytest.skip("the sampler differs from HEAD's: the baseline would be another sampler")
    report = sample_bench.main(["--vocab", "300", "--batches", "4", "--repeats", "2", "--threads", "1",
                                "--modes", "sample,sample_rep", "--baseline", "HEAD", "--out", str(tmp_path)])
    assert [r["differing_draws"] for r in report["rows"]] == [0, 0, 0, 0]
    assert all(r["draws"] == 8 and r["before"]["min_ms"] > 0 for r in report["rows"])
