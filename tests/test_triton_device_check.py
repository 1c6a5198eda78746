"""The device check's CPU path: it compiles the kernels for sm_90 (no GPU needed: catches
GPU-only errors, shared-memory overuse and TF32 in fp32 dots), then, without CUDA, says what
it would measure and exits 0 without writing results."""
import json
import os
import subprocess
import sys

import pytest


def test_device_check_cpu_mode(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}  # compiled kernels, no CUDA
    proc = subprocess.run([sys.executable, "-m", "radixserve.bench.device_check", "--compile-check",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == 6 and not any("TOO MUCH" in line or "TF32" in line for line in compiled)
    assert "would" in proc.stdout and "bandwidth" in proc.stdout
    assert "decode bs=" in proc.stdout and "extend bs=" in proc.stdout
    assert not list(tmp_path.iterdir()), "the dry run must not write results"


@pytest.mark.gpu
def test_device_check_quick_on_gpu(tmp_path):
    """Compiled kernels vs the reference in bf16 and fp32 (TF32 would fail) on small GPU cases.
    A subprocess, so the kernels compile even where conftest turned the interpreter on."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "radixserve.bench.device_check", "--quick",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert len(report["cases"]) == 4
    for case in report["cases"]:
        assert case["ok"] and case["store_ok"], case
        assert case["max_err_fp32"] <= 1e-5 and case["max_err_bf16"] <= 2e-2, case
