"""bench/agent_trace_peer.py without vLLM: equal KV bytes in tokens, and rows that are medians per server."""
from radixserve.bench.agent_trace_peer import kv_bytes_per_token, summarize


def test_kv_bytes_per_token_is_layers_times_k_and_v_times_heads_times_head_dim():
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    assert kv_bytes_per_token(config, "bfloat16") == 24 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(config, "float32") == 2 * kv_bytes_per_token(config, "bfloat16")


def test_rows_are_medians_per_kv_size_and_server():
    def run(server, rate):
        return {"kv_gib": 1, "kv_tokens": 100, "server": server, "agents_per_min": rate, "turn_p50_s": rate / 10,
                "turn_p99_s": rate / 5, "recomputed": rate, "excess": 0, "wall_s": 60 / rate}
    rows = summarize([run("ours", 30), run("vllm", 10), run("ours", 20), run("vllm", 14), run("ours", 40),
                      run("vllm", 12)])
    assert [(r["server"], r["agents_per_min"]) for r in rows] == [("ours", 30), ("vllm", 12)]
