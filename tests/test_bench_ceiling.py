"""bench/ceiling.py: the upper bound of the linear-FLOP roofline fraction, computed by hand on a tiny workload, and
its report over the real workload generators (no timing: rates are given)."""
from __future__ import annotations

import pytest

from radixserve.bench import ceiling as ce
from radixserve.bench.harness import stand_in_rounds
from radixserve.radix.optimal import Computed, computed_spans
from radixserve.bench.peer_vllm import PEER_WORKLOADS
from radixserve.bench.workloads import make_workload

# One layer of seven 4 x 4 projections: P_linear = 112; a 4 x 4 LM head: P_head = 16; 2 heads of 2 dims.
TINY = {"hidden_size": 4, "intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 2, "num_hidden_layers": 1, "vocab_size": 4}
# A conversation: round 1 resends round 0's prompt and output, then one new token.
ROUNDS = [[([1, 2, 3], [9, 9])], [([1, 2, 3, 9, 9, 5], [7])]]


def test_computed_spans_follow_the_trie():
    assert computed_spans(ROUNDS) == [[Computed(0, 3, 2)], [Computed(5, 6, 1)]]
    # Identical prompts in one round: the second still computes its last token.
    assert computed_spans([[([4, 5], [1]), ([4, 5], [1])]]) == [[Computed(0, 2, 1), Computed(1, 2, 1)]]


def test_decode_batches_split_a_round_by_max_running():
    spans = [Computed(0, 1, 2), Computed(0, 1, 1), Computed(0, 1, 3)]
    assert ce._decode_batches(spans, max_running=2) == [2, 1, 1, 1, 1]
    assert ce._decode_batches(spans, max_running=64) == [3, 2, 1]


def test_ceiling_by_hand():
    # 1 FLOP/s; one read of the 512 fp32 weight bytes (linears and head) takes 300 s, more than a 1-sequence
    # step's 256 FLOPs.
    c = ce.ceiling(TINY, ROUNDS, gflops=1e-9, stream_gbs=512 / 300 / 1e9)
    assert c.linear_roof_s == pytest.approx(2 * 112 * (4 + 3))  # 4 computed prompt positions, 3 outputs
    assert c.prefill_s == pytest.approx(2 * 112 * 4)
    assert c.decode_steps == 3 and c.decode_s == pytest.approx(3 * 300)
    # positions 0..4 see 1..5 keys, positions 5..6 see 6..7: 28 pairs x 4 x 2 heads x 2 dims
    assert c.attention_s == pytest.approx(28 * 16)
    assert c.max_fraction == pytest.approx(1568 / (896 + 900 + 448))
    fast_memory = ce.ceiling(TINY, ROUNDS, gflops=1e-9, stream_gbs=1.0)  # steps bound by FLOPs instead
    assert fast_memory.decode_s == pytest.approx(3 * 256)
    bf16 = ce.ceiling(TINY, ROUNDS, gflops=1e-9, stream_gbs=512 / 300 / 1e9, dtype_bytes=2)  # a read takes 150 s
    assert bf16.decode_s == pytest.approx(3 * 256)
    slow_bf16 = ce.ceiling(TINY, ROUNDS, gflops=1e-9, stream_gbs=256 / 600 / 1e9, dtype_bytes=2)
    assert slow_bf16.decode_s == pytest.approx(3 * 600)


def test_report_over_the_real_workloads():
    workloads = {n: stand_in_rounds(lambda n=n: make_workload(n, "tiny", 0)) for n in PEER_WORKLOADS}
    peer = {"rows": [{"workload": "gsp", "engine": "radixserve", "roofline_fraction": 0.4},
                     {"workload": "gsp", "engine": "vllm-b128", "roofline_fraction": None}]}
    report = ce.build_report(TINY, workloads, gflops=300.0, stream_gbs=20.0, measured=ce.measured_fractions(peer),
                             dtype="bfloat16")
    assert report["dtype"] == "bfloat16"
    assert [row["workload"] for row in report["rows"]] == list(PEER_WORKLOADS)
    for row in report["rows"]:
        assert 0 < row["max_fraction"] <= 1
        assert row["best_s"] == pytest.approx(row["prefill_s"] + row["decode_s"] + row["attention_s"])
    assert report["rows"][0]["measured"] == {"radixserve": 0.4}
    text = ce.markdown(report)
    assert "| gsp |" in text and "40% |" in text and "radixserve reached" in text
    assert "bfloat16 matmul roofline" in text
