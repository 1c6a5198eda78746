"""bench/engine_ab.py: two engine configurations in two processes, alternating, and its report."""
import json

from radixserve.bench import engine_ab


def test_summary_takes_medians_and_the_speedup_of_b():
    runs = [{"workload": "gsp", "side": side, "rep": rep, "wall_s": wall, "requests": 8, "minor_faults": faults,
             "system_s": 0.1}
            for side, walls, faults in (("a", (2.0, 4.0, 3.0), 900), ("b", (1.0, 1.5, 2.0), 10))
            for rep, wall in enumerate(walls)]
    (row,) = engine_ab.summarize(runs, ("a", "b"))
    assert row["a"]["wall_s"] == 3.0 and row["b"]["wall_s"] == 1.5 and row["speedup"] == 2.0
    assert row["a"]["req_per_s"] == 8 / 3.0 and row["a"]["minor_faults"] == 900
    assert row["b"]["wall_s_runs"] == [1.0, 1.5, 2.0]


def test_two_processes_alternate_on_the_tiny_model(tmp_path):
    report = engine_ab.main(["--model", "tiny", "--size", "tiny", "--workloads", "gsp", "--reps", "2",
                             "--threads", "1", "--settle-s", "0", "--a", '{"release_host_memory": true}',
                             "--label-a", "release", "--label-b", "retain", "--out", str(tmp_path), "--name", "ab"])
    assert [(r["side"], r["rep"]) for r in report["runs"]] == [("release", 0), ("retain", 0),
                                                                ("retain", 1), ("release", 1)]
    assert all(r["wall_s"] > 0 and r["requests"] > 0 and r["minor_faults"] >= 0 for r in report["runs"])
    assert report["configs"]["release"]["release_host_memory"] is True
    assert "release_host_memory" not in report["configs"]["retain"]
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["rows"][0]["workload"] == "gsp" and saved["rows"][0]["speedup"] > 0
    assert "| gsp |" in (tmp_path / "ab.md").read_text()


def test_a_side_can_run_the_code_of_another_checkout(tmp_path):
    """--src-b: side b imports radixserve from that checkout (here this one, through a link), side a the installed
    package; the report names both."""
    import os

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(engine_ab.__file__)))
    sides = {}
    try:
        sides["a"] = engine_ab.Child("a", "tiny", "tiny", 1, {})
        sides["b"] = engine_ab.Child("b", "tiny", "tiny", 1, {}, src=checkout)
        assert sides["a"].package == os.path.dirname(os.path.abspath(engine_ab.__file__))
        assert sides["b"].package.startswith(sides["b"]._link_dir.name)  # imported through the link
        assert sides["b"].run("gsp")["requests"] > 0
    finally:
        for side in sides.values():
            side.close()
    assert "checkout " + checkout in engine_ab._describe(checkout)
