"""bench/output.py, the rule every bench follows on the way out: a fresh directory unless --out names one, JSON and
Markdown always, the PNG only with matplotlib (and then no stale one left), the table and the paths printed at the
end, and a --help in a user's words; plus one short bench end to end from a bare working directory."""
import datetime
import importlib
import json
import sys

import pytest
from radixserve.bench import output, report_http, run_cache_bench, run_prefix_bench
from radixserve.bench.output import DEFAULT_ROOT, PNG_SKIPPED, BenchOutput

CLIS = ("run_prefix_bench", "run_cache_bench", "http_bench", "peer_serve", "peer_vllm", "ceiling", "engine_ab",
        "grammar_bench", "router_bench", "responses_bench", "device_check")
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5)


def _draw(path):
    with open(path, "wb") as f:
        f.write(b"\x89PNG drawn")


def test_default_is_a_fresh_directory_made_on_first_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = BenchOutput("demo", now=NOW), BenchOutput("demo", now=NOW)
    assert not (tmp_path / DEFAULT_ROOT).exists()  # nothing until a file is written
    first.write_text("a.md", "one")
    second.write_text("a.md", "two")  # same second: a directory of its own, not the first one's
    assert first.dir == f"{DEFAULT_ROOT}/demo-20260102-030405" and second.dir == first.dir + "-2"
    assert (tmp_path / first.dir / "a.md").read_text() == "one\n"
    assert (tmp_path / second.dir / "a.md").read_text() == "two\n"


def test_out_is_a_directory_created_if_missing_and_same_names_are_replaced(tmp_path):
    target = tmp_path / "results" / "nested"
    for value in (1, 2):
        out = BenchOutput("demo", str(target))
        out.write_report("demo_S", {"value": value}, "# table\n", _draw)
    assert sorted(p.name for p in target.iterdir()) == ["demo_S.json", "demo_S.md", "demo_S.png"]
    assert json.loads((target / "demo_S.json").read_text()) == {"value": 2}
    assert out.written == [str(target / n) for n in ("demo_S.json", "demo_S.png", "demo_S.md")]


def test_without_matplotlib_the_png_is_skipped_said_and_no_stale_one_stays(tmp_path, monkeypatch, capsys):
    (tmp_path / "demo_S.png").write_bytes(b"an older run's plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = BenchOutput("demo", str(tmp_path))
    out.write_report("demo_S", {"k": 1}, "# t\n\n![plot](demo_S.png)\n", _draw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo_S.json", "demo_S.md"]
    md = (tmp_path / "demo_S.md").read_text()
    assert "![plot]" not in md and f"(plot skipped: {PNG_SKIPPED})" in md
    out.finish("| a | b |")
    printed = capsys.readouterr().out
    assert f"demo_S.png skipped: {PNG_SKIPPED}" in printed and "radixserve[bench]" in printed


def test_a_real_report_writer_without_matplotlib(tmp_path, monkeypatch):
    """http_bench's writer used to die at its last step and leave the previous PNG."""
    (tmp_path / "http_bench_tiny.png").write_bytes(b"stale")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    levels = [{"concurrency": 1, "http": None, "offline": None, "ratio": None, "paired_ratios": []}]
    config = {"command": "python -m radixserve.bench.http_bench", "model": "tiny", "model_path": "/m/ckpt",
              "workload": {"num_groups": 1, "per_group": 1, "system_len": 8, "question_len": 2, "output_len": 2},
              "threads": 1, "engine": {}, "runs": 1}
    out = BenchOutput("http_bench", str(tmp_path))
    text = report_http.write_report({"config": config, "levels": levels, "target_ratio": None}, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["http_bench_tiny.json", "http_bench_tiny.md"]
    assert (tmp_path / "http_bench_tiny.md").read_text() == text  # what the run prints is what it wrote
    assert "http_bench_tiny.png" not in text and f"(plot skipped: {PNG_SKIPPED})" in text
    assert out.notes == [f"http_bench_tiny.png skipped: {PNG_SKIPPED}"]


def test_finish_prints_the_table_then_every_path(tmp_path, capsys):
    out = BenchOutput("demo", str(tmp_path))
    out.write_json("r.json", {})
    out.write_text("r.md", "| x |")
    out.finish("| x |\n|---|\n| 1 |\n")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["| x |", "|---|", "| 1 |"]
    assert lines[4] == f"Wrote 2 file(s) to {tmp_path}:"
    assert lines[5:] == [f"  {tmp_path / 'r.json'}", f"  {tmp_path / 'r.md'}"]


class _Parsed(Exception):
    pass


def _parser_of(module, monkeypatch):
    """The bench's own parser, caught where it would parse (nothing else of the bench runs)."""
    mod = importlib.import_module(f"radixserve.bench.{module}")

    def catch(parser, argv):
        raise _Parsed(parser)

    monkeypatch.setattr(mod, "parse_args", catch)
    with pytest.raises(_Parsed) as caught:
        mod.main([])
    return caught.value.args[0]


@pytest.mark.parametrize("module", CLIS)
def test_every_flag_has_help_in_a_users_words_and_out_is_a_directory(module, monkeypatch):
    parser = _parser_of(module, monkeypatch)
    assert parser.prog == f"python -m radixserve.bench.{module}"
    (out,) = [a for a in parser._actions if "--out" in a.option_strings]
    assert out.help == output.OUT_HELP and out.metavar == "DIR" and out.default is None
    text = parser.format_help()
    for action in parser._actions:
        if action.help != "==SUPPRESS==":
            assert action.help and len(action.help) > 10, (module, action.option_strings)
    for word in ("issue", "§", "results/"):
        assert word not in text.replace("bench/results/peer_vllm", ""), (module, word)


def test_prefix_bench_end_to_end_into_a_fresh_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_prefix_bench.main(["--size", "tiny", "--model", "tiny", "--runs", "1"])
    (run_dir,) = (tmp_path / DEFAULT_ROOT).iterdir()
    assert run_dir.name.startswith("prefix_bench-")
    assert sorted(p.name for p in run_dir.iterdir()) == ["prefix_bench.json", "prefix_bench.md"]
    printed = capsys.readouterr().out
    assert "| cache on |" in printed and "| cache off |" in printed
    assert printed.rstrip().endswith(f"{DEFAULT_ROOT}/{run_dir.name}/prefix_bench.md")


def test_cache_bench_without_matplotlib_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run_cache_bench.main(["--size", "tiny", "--workloads", "gsp", "--policies", "fcfs", "--budgets", "1.0",
                          "--skip", "eviction,starve,overhead,speed", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache_bench.json", "cache_bench.md"]
    printed = capsys.readouterr().out
    assert "| gsp |" in printed and f"cache_bench.png skipped: {PNG_SKIPPED}" in printed
