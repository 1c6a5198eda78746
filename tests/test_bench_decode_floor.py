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


def test_report_divides_by_the_floor():
    result = {"command": "x", "model": "L", "dtype": "bfloat16", "threads": 2, "context": 1000, "stream_gib": 2,
              "stream_gbs": 20.0, "weight_bytes": 1_000_000_000, "kv_bytes_per_token": 10_000,
              "decode": [{"batch": 1, "step_ms": 75.0, "linear_ms": 60.0, "decode_steps": 8},
                         {"batch": 10, "step_ms": 110.0, "linear_ms": 70.0, "decode_steps": 8}],
              "linear_rates": [{"rows": 1, "method": "packed", "ms": 1.0, "gflops": 30.0, "weight_gbs": 25.0}],
              "head_rates": [{"rows": 16, "method": "packed copy", "ms": 11.8, "gflops": 1.0, "weight_gbs": 23.1}]}
    markdown, table = decode_floor.report(result)
    # floor 1e9 B / 20 GB/s = 50 ms; batch 10 also reads 10 * 1000 * 10 kB = 100 MB of KV: 55 ms
    assert "| 1 | 75.0 | 60.0 | 50.0 | 1.20x | 10 | 1.49x |" in table
    assert "| 10 | 110.0 | 70.0 | 50.0 | 1.40x | 100 | 2.00x |" in table
    assert table in markdown and "| 1 | packed | 1.000 | 30 | 25.0 |" in markdown
    assert "| 16 | packed copy | 11.80 | 23.1 |" in markdown


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
