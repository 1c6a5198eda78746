"""bench/agent_trace_peer.py without vLLM: equal KV bytes in tokens, and rows that are medians per server."""
from types import SimpleNamespace

import pytest

from radixserve.bench.agent_trace_peer import _parse, kv_bytes_per_token, kv_sizes, summarize


def test_kv_bytes_per_token_is_layers_times_k_and_v_times_heads_times_head_dim():
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    assert kv_bytes_per_token(config, "bfloat16") == 24 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(config, "float32") == 2 * kv_bytes_per_token(config, "bfloat16")


def test_rows_are_medians_per_kv_size_and_server():
    def run(server, rate):
        return {"kv": "1 GiB", "kv_tokens": 100, "kv_bytes": 1000, "server": server, "agents_per_min": rate,
                "turn_p50_s": rate / 10, "turn_p99_s": rate / 5, "recomputed": rate, "excess": 0, "wall_s": 60 / rate}
    rows = summarize([run("ours", 30), run("vllm", 10), run("ours", 20), run("vllm", 14), run("ours", 40),
                      run("vllm", 12)])
    assert [(r["server"], r["agents_per_min"]) for r in rows] == [("ours", 30), ("vllm", 12)]


def test_kv_sizes_are_whole_vllm_blocks_in_gib_or_fractions_of_the_calibrated_working_set():
    gib = SimpleNamespace(budgets=None, kv_gib=[1.0, 0.5], block_size=32)
    never = lambda: pytest.fail("GiB sizes need no calibration run")  # noqa: E731
    assert kv_sizes(gib, 12288, never) == [("1 GiB", 87360), ("0.5 GiB", 43680)]  # 87381 and 43690 slots, in blocks
    calls = []

    def calibrate():
        calls.append(1)
        return 90001
    fractions = SimpleNamespace(budgets=[0.5, 1.0], kv_gib=[1.0], block_size=32)
    assert kv_sizes(fractions, 12288, calibrate) == [("0.5 of 90001", 44992), ("1 of 90001", 89984)]
    assert calls == [1]  # one calibration for every budget


def test_budgets_parse_as_fractions_and_gib_as_decimals():
    args = _parse(["--vllm-python", "python", "--budgets", "0.5,1", "--kv-gib", "0.75"])
    assert args.budgets == [0.5, 1.0] and args.kv_gib == [0.75]
    assert _parse(["--vllm-python", "python"]).budgets is None
