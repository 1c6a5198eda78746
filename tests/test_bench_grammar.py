"""bench/grammar_bench.py runs end to end on the tiny bench model and writes what it promises."""
import json

import pytest

pytest.importorskip("xgrammar")

from radixserve.bench import grammar_bench  # noqa: E402


def test_grammar_bench_writes_json_and_markdown(tmp_path):
    report = grammar_bench.main(["--model", "tiny", "--size", "tiny", "--repeats", "1", "--out", str(tmp_path)])
    cases = report["cases"]
    for b in (1, 2):
        assert cases[f"unconstrained@{b}"]["finish"] == {"length": b}
        assert cases[f"json_schema@{b}"]["finish"] == {"length": b}  # fixed length: the string never closes
        assert cases[f"json_schema@{b}"]["completion_tokens"] == b * report["output_len"]
        off, on = cases[f"jump_off@{b}"], cases[f"jump_on@{b}"]
        assert off["finish"] == on["finish"] == {"stop": b}
        assert off["valid"] and on["valid"]
        assert off["num_jump_forward_tokens"] == 0 < on["num_jump_forward_tokens"]
        assert on["num_steps"] < off["num_steps"]
        assert set(report["ratios"][str(b)]) == {"schema_vs_unconstrained_tok_per_s", "jump_on_vs_off_req_per_s",
                                                 "jump_on_vs_off_chars_per_s", "jump_on_vs_off_steps"}
    saved = json.loads((tmp_path / "grammar_bench.json").read_text())
    assert saved["ratios"] == report["ratios"]
    md = (tmp_path / "grammar_bench.md").read_text()
    assert "## Jump-forward off vs on" in md and "| 2 |" in md


def test_schemas_are_what_the_bench_says():
    assert grammar_bench.fixed_length_schema(9) == {"type": "string", "minLength": 9, "maxLength": 9}
    schema = grammar_bench.long_keys_schema(4)
    assert list(schema["properties"]) == grammar_bench.LONG_KEYS[:4] == schema["required"]
