"""bench/quant_quality.py: configuration names, issue 39's thresholds, the scoring against fp32 (a drop past the
threshold fails), and a run on the tiny bench model with a few cases whose checks are known."""
from __future__ import annotations

import json

import pytest

from radixserve.bench import quant_quality as qq
from radixserve.kernels import native, quant_linear


def test_configuration_names_map_onto_engine_keywords():
    assert qq.engine_config("bf16+int4-g128+kv-int8", 1).items() >= {
        "dtype": "bfloat16", "quantization": "int4-g128", "kv_cache_dtype": "int8"}.items()
    plain = qq.engine_config("fp32", 2)
    assert plain["dtype"] == "float32" and "quantization" not in plain and "kv_cache_dtype" not in plain
    assert [qq.threshold(c) for c in ("fp32", "bf16", "int8-g32", "kv-int8", "int4", "int4+kv-int8")] == \
        [None, None, 1.0, 1.0, 5.0, 5.0]


def _run(config: str, right: dict[str, list[bool]], ids: dict[str, list[list[int]]]) -> dict:
    return {"config": config, "engine": {}, "runtime": {}, "linears": {"quantized": 0, "float": 0, "float_names": []},
            "sets": {n: {"right": right[n], "output_ids": ids[n]} for n in right}}


def test_scoring_counts_points_identity_and_fails_past_the_threshold():
    ids = {"a": [[1, 2]] * 50, "b": [[3]] * 50}
    base = _run("fp32", {"a": [True] * 50, "b": [True] * 49 + [False]}, ids)
    assert qq.score(base, base)["points"] == 99.0 and qq.score(base, base)["identical"] == 100
    # int8 losing 2 cases of set a (2 points): past its 1 point; the same drop holds int4's 5
    lost = {"a": [False, False] + [True] * 48, "b": base["sets"]["b"]["right"]}
    changed = {"a": [[9]] * 3 + [[1, 2]] * 47, "b": ids["b"]}
    s8 = qq.score(_run("int8", lost, changed), base)
    assert (s8["right"], s8["total"], s8["points"], s8["diff_points"]) == (97, 100, 97.0, -2.0)
    assert s8["identical"] == 97 and s8["differing"] == {"a": [0, 1, 2]} and s8["sets_lost"] == {"a": 2}
    assert s8["meets_threshold"] is False and s8["sets"] == {"a": "48/50", "b": "49/50"}
    assert qq.score(_run("int4", lost, changed), base)["meets_threshold"] is True
    one = {"a": [False] + [True] * 49, "b": base["sets"]["b"]["right"]}  # exactly 1 point down: held
    assert qq.score(_run("kv-int8", one, ids), base)["meets_threshold"] is True


@pytest.mark.skipif(native.cannot_build() is not None or quant_linear.kernel() is None,
                    reason="needs the native library and AMX tiles or AVX512-BF16")
def test_a_run_on_the_tiny_model(tmp_path):
    """The replies are scored by the cases' own checks (one always right, one never), fp32's replies are its own,
    and int4-g128 on the tiny model (K = 64 or 128) quantizes only the down projections."""
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    sets = {"s": [(msgs, None, lambda reply: True), (msgs, None, lambda reply: False)]}
    report = qq.main(["--model", "tiny", "--configs", "int4-g128,kv-int8", "--out", str(tmp_path)], sets=sets)
    fp32, g128, kv = report["configs"]
    assert [c["config"] for c in report["configs"]] == ["fp32", "int4-g128", "kv-int8"]
    assert all(c["sets"] == {"s": "1/2"} and c["points"] == 50.0 and c["diff_points"] == 0 for c in (fp32, g128, kv))
    assert fp32["identical"] == 2 and fp32["runtime"] == {"dtype": "float32", "kv_cache": "float32"}
    assert kv["runtime"]["kv_cache"] != "float32" and kv["linears"]["quantized"] == 0
    assert g128["linears"]["quantized"] == 2 and g128["linears"]["float_names"][0] == "lm_head"
    assert json.loads((tmp_path / "quant_quality.json").read_text())["configs"][1]["threshold_points"] == 5.0
    assert "| int4-g128 | 1/2 (50.0) | +0.0 |" in (tmp_path / "quant_quality.md").read_text()
