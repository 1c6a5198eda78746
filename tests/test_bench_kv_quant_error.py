"""bench/kv_quant_error.py: the two row schemes' rounding, the float64 attention it compares, and a run on the tiny
bench model whose capture reproduces the model's own attention."""
from __future__ import annotations

import json
import math

import pytest
import torch

from radixserve.bench import kv_quant_error as kqe
from radixserve.bench.kv_quant_error import causal_attention, layer_errors, quantize_rows, relative_error


def test_known_rows_separate_the_schemes():
    # [127, 1]: int8's scale is 1, exact; fp8's is 127/448, and 1 / (127/448) = 3.53 rounds to 3.5 (3 mantissa bits).
    row = torch.tensor([[127.0, 1.0, 0.0, 0.0]])
    assert relative_error(quantize_rows(row, "int8"), row) == 0
    fp8 = quantize_rows(row, "fp8_e4m3")
    assert fp8[0, 1].item() == pytest.approx(3.5 * 127 / 448, rel=1e-6)
    assert relative_error(fp8, row) == pytest.approx((1 - 3.5 * 127 / 448) / math.hypot(127, 1), rel=1e-5)
    # [448, 1]: fp8's scale is 1, exact; int8's is 448/127 and 1 rounds to 0.
    row = torch.tensor([[448.0, 1.0, 0.0, 0.0]])
    assert relative_error(quantize_rows(row, "fp8_e4m3"), row) == 0
    assert relative_error(quantize_rows(row, "int8"), row) == pytest.approx(1 / math.hypot(448, 1), rel=1e-6)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_each_scheme_rounds_within_its_step(magnitude):
    x = torch.randn(50, 2, 64, generator=torch.Generator().manual_seed(1)) * magnitude
    x[0, 0] = 0.0
    top = x.abs().amax(-1, keepdim=True).double()
    x64 = x.double()
    assert ((quantize_rows(x, "int8") - x64).abs() <= top / 127 * (0.5 + 1e-5)).all()
    # e4m3: a relative half step of 2^-4 on normals, 2^-10 (of the scale) on subnormals
    step = torch.maximum(x64.abs() * 2.0 ** -4, top / 448 * 2.0 ** -10)
    error = (quantize_rows(x, "fp8_e4m3") - x64).abs()
    assert (error <= step * (1 + 1e-5)).all() and (error > 0).any()
    assert (quantize_rows(x, "int8")[0, 0] == 0).all() and (quantize_rows(x, "fp8_e4m3")[0, 0] == 0).all()


def test_the_causal_attention_is_grouped_and_causal():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(4, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8,
                                                                                                   generator=gen)
    out = causal_attention(q, k, v, 0.3)
    for h in range(4):  # heads 0, 1 read kv head 0; 2, 3 read kv head 1
        for i in range(5):
            w = torch.softmax(q[h, i].double() @ k[h // 2, : i + 1].double().T * 0.3, -1)
            assert torch.allclose(out[h, i], w @ v[h // 2, : i + 1].double(), atol=1e-12)


def test_layer_errors_vanish_on_exact_rows_only():
    gen = torch.Generator().manual_seed(3)
    exact = torch.randint(-1, 2, (2, 6, 8), generator=gen).float() * 4.0  # 0 and +-max: codes exact in both
    exact[:, :, 0] = 4.0
    q = torch.randn(4, 6, 8, generator=gen)
    for scheme in kqe.SCHEMES:  # off by the float32 scale's rounding (4 / 127, 4 / 448) only
        assert all(e < 1e-7 for e in layer_errors(q, exact, exact, 0.35, scheme).values())
        k, v = torch.randn(2, 6, 8, generator=gen), torch.randn(2, 6, 8, generator=gen)
        assert all(1e-4 < e < 0.1 for e in layer_errors(q, k, v, 0.35, scheme).values())


def test_a_run_on_the_tiny_model_captures_its_attention(tmp_path):
    report = kqe.main(["--models", "tiny", "--tokens", "40", "--out", str(tmp_path)])
    (m,) = report["models"]
    assert (m["layers"], m["kv_heads"], m["head_dim"], m["dtype"]) == (2, 2, 16, "float32")
    assert m["reference_error"] < 1e-5  # the float64 attention over the captured q, K, V is the model's own
    assert all(0 < m["summary"][s][f"{x}_median"] <= m["summary"][s][f"{x}_max"] < 0.2
               for s in kqe.SCHEMES for x in ("k", "v", "out"))
    assert json.loads((tmp_path / "kv_quant_error.json").read_text())["models"][0]["tokens"] == 40
    assert "| tiny | fp8 / int8 |" in (tmp_path / "kv_quant_error.md").read_text()
