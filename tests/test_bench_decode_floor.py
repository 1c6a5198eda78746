"""bench/decode_floor.py: the bytes a decode step must read, the floor they give, and its report."""
from __future__ import annotations

import torch

from radixserve.bench import decode_floor, roofline
from radixserve.kernels import native

QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
            "num_hidden_layers": 24, "vocab_size": 151936}


def test_weight_and_kv_bytes_of_the_qwen2_5_0_5b_shape():
    # per layer: q 896x896, k and v 896x128 each, o 896x896, gate and up 896x4864 each, down 4864x896
    per_layer = 896 * 896 * 2 + 896 * 128 * 2 + 896 * 4864 * 3
    assert decode_floor.weight_bytes(QWEN_05B, 2) == 2 * (24 * per_layer + 151936 * 896)
    assert roofline.kv_bytes_per_token(QWEN_05B, 2) == 2 * 2 * 24 * 2 * 64  # K and V, bf16: 12 KiB


def test_each_round_is_divided_by_the_bandwidth_measured_around_it():
    config = {"hidden_size": 10, "vocab_size": 100, "intermediate_size": 20, "num_attention_heads": 1,
              "num_key_value_heads": 1, "num_hidden_layers": 1, "head_dim": 10}
    result = {"command": "x", "model": "L", "dtype": "bfloat16", "threads": 2, "context": 1000, "stream_gib": 2,
              "weight_bytes": 1_000_000_000, "kv_bytes_per_token": 10_000, "rounds": 2,
              "stream_gbs_rounds": [10.0, 30.0, 20.0],
              "linear_rates": [{"rows": 1, "method": "tiles", "ms": 1.0, "gflops": 30.0, "weight_gbs": 25.0},
                               {"rows": 512, "method": "tiles", "ms": 1.0, "gflops": 1e-3, "weight_gbs": 1.0}],
              "head_rates": [{"rows": 16, "method": "packed copy", "ms": 11.8, "gflops": 1.0, "weight_gbs": 23.1}]}
    result["peak_gflops"] = decode_floor.peak_gflops(result["linear_rates"])
    assert result["peak_gflops"] == 30.0
    # round 1 around 10 and 30 GB/s (20: a 50 ms floor), round 2 around 30 and 20 (25: 40 ms)
    runs = [({"batch": 1, "step_ms": 75.0, "linear_ms": 60.0}, 20.0), ({"batch": 1, "step_ms": 70.0, "linear_ms": 44.0}, 25.0)]
    row = decode_floor.summarize(config, result, runs)
    assert row["floor_ms"] == 45.0 and row["linear_ms"] == 52.0
    # 60 / 50 and 44 / 40: 1.2 and 1.1, so 1.15 (not 52 / 45, nor against the median bandwidth's 50 ms floor)
    assert abs(row["vs_floor"] - 1.15) < 1e-9
    flops = 2 * (decode_floor.roofline.linear_params(config) + 100 * 10)
    assert abs(row["compute_floor_ms"] - flops / 30.0 / 1e6) < 1e-12
    assert row["vs_max_floor"] == row["vs_floor"]  # the compute floor is far below the weights' here
    result["decode"] = [row]
    markdown, table = decode_floor.report(result)
    assert "| 1 | 72.5 | 52.0 | 45.0 |" in table and "| 1.15x | 1.15x | 10 |" in table
    assert "median of 3 measurements around the rounds (10.0-30.0" in markdown
    assert "| 1 | tiles | 1.000 | 30 | 25.0 |" in markdown and "| 16 | packed copy | 11.80 | 23.1 |" in markdown


def test_a_compute_floor_above_the_weights_is_the_one_a_ratio_is_taken_against():
    config = {"hidden_size": 10, "vocab_size": 100, "intermediate_size": 20, "num_attention_heads": 1,
              "num_key_value_heads": 1, "num_hidden_layers": 1, "head_dim": 10}
    result = {"context": 10, "kv_bytes_per_token": 1, "weight_bytes": 1_000_000, "peak_gflops": 1e-3}
    row = decode_floor.summarize(config, result, [({"batch": 16, "step_ms": 9.0, "linear_ms": 8.0}, 100.0)])
    assert row["floor_ms"] == 0.01 and row["compute_floor_ms"] > 8.0
    assert row["vs_max_floor"] == 8.0 / row["compute_floor_ms"] and row["vs_floor"] == 800.0


def _methods() -> list[str]:
    tiles = native.cannot_build() is None and native.tiles_supported(torch.zeros(16, 32, dtype=torch.bfloat16))
    return (["tiles"] if tiles else []) + ["oneDNN packed"]


def test_head_rates_time_every_layout_of_a_small_head():
    config = {"hidden_size": 32, "vocab_size": 96}
    rows = decode_floor.head_rates(config, "bfloat16", [1, 4], repeats=2)
    methods = _methods() + ["shared table"]
    assert [(r["rows"], r["method"]) for r in rows] == [(m, k) for m in (1, 4) for k in methods]
    assert all(r["ms"] > 0 and r["weight_gbs"] > 0 for r in rows)


def test_linear_rates_time_every_method_over_distinct_copies_at_few_rows():
    config = {**QWEN_05B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32}
    rows = decode_floor.linear_rates(config, "bfloat16", [1, 128], repeats=1)
    methods = _methods() + ["matmul"]
    assert [(r["rows"], r["method"]) for r in rows] == [(m, k) for m in (1, 128) for k in methods]
    assert all(r["ms"] > 0 for r in rows)
    assert decode_floor._copies(10**6, 1) == decode_floor.MAX_COPIES and decode_floor._copies(10**9, 1) == 2
    assert decode_floor._copies(10**6, 128) == 1
