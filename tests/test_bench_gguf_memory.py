"""bench/gguf_memory.py on the tiny shape: a file written where missing, loaded and served in a child process, with
its blocks kept on the quantized kernel of the engine's dtype (one engine per --quantized-activations value) or
dequantized at load (--dequantize); llama.cpp's side skipped where its binary is absent."""
from __future__ import annotations

import json

import pytest

from radixserve.bench import gguf_memory
from radixserve.kernels import native, quant_act


@pytest.mark.skipif(native.cannot_build() is not None, reason=native.cannot_build() or "")
def test_kept_blocks_hold_less_than_dequantized_ones(tmp_path):
    path = str(tmp_path / "tiny-q4_0.gguf")
    rows = {}
    for dequantize in (False, True):
        out = tmp_path / f"out{int(dequantize)}"
        gguf_memory.main(["--shape", "tiny", "--gguf", path, "--context", "16", "--new-tokens", "2", "--runs", "1",
                          "--kv-cache-tokens", "256", "--dtype", "float32", "--settle-s", "0", "--stream-gib", "0.01",
                          "--llama-bench", str(tmp_path / "absent"), "--out", str(out),
                          *(["--dequantize"] if dequantize else ["--quantized-activations", "auto,none"])])
        (report,) = out.glob("*.json")
        assert report.name == ("gguf_memory_tiny-q4_0_float32" + ("_dequantized" if dequantize else "_act-auto-none")
                               + ".json")
        rows[dequantize] = json.loads(report.read_text())
    kept, dequantized = rows[False], rows[True]
    assert kept["kernel"] == "fp32" and dequantized["kernel"] is None and kept["dtype"] == "float32"
    # Q4_0 kept: 5 bits a weight against fp32's 32 (the norms and the tiny model's 1-D tensors are float in both)
    assert kept["streamed_per_token"] * 4 < dequantized["streamed_per_token"]
    # one engine per --quantized-activations value, alternating; auto takes int8 activations on this fp32 kernel
    assert sorted(r["engine"] for r in kept["runs"]) == ["radixserve (auto)", "radixserve (none)"]
    assert all(r["decode_tok_s"] > 0 for r in kept["runs"])
    flags = {name: e["int8_activations"] for name, e in kept["engines"].items()}
    assert flags == {"radixserve (auto)": quant_act.ready(), "radixserve (none)": False}
    assert [r["engine"] for r in dequantized["runs"]] == ["radixserve"]
