"""Loading holds no second copy of the weights (issue 35 item 10), and the safetensors reader it rests on."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.bench.harness import bench_model_path
from radixserve.kernels.loader import BF16_CPU_FLAGS, cpu_flags, read_safetensors

# Run in a fresh process so ru_maxrss is this load's peak: RSS before loading (imports done), the peak, and the RSS
# once loaded, in KiB.
_MEASURE = """
import json, resource, sys
import torch
from radixserve.kernels import ModelRunner

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

torch.set_num_threads(1)
before = rss_kib()
runner = ModelRunner(sys.argv[1], num_slots=64, attention_backend="torch", device="cpu")
loaded = rss_kib()
print(json.dumps(dict(before=before, loaded=loaded, peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      dtype=str(runner.dtype))))
"""


def _weights_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_loading_model_l_holds_no_second_copy():
    path = bench_model_path("L")  # built here, so building is not part of the measured peak
    out = subprocess.run([sys.executable, "-c", _MEASURE, path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    weights_kib = _weights_bytes(path) / 1024
    native_bf16 = bool(set(BF16_CPU_FLAGS) & cpu_flags())
    assert rss["dtype"] == ("torch.bfloat16" if native_bf16 else "torch.float32")  # what auto picks on this CPU
    scale = 1 if native_bf16 else 2  # a bf16 checkpoint run in fp32 holds twice its bytes
    # No transient copy: the peak while loading is at most a quarter of the weights above what stays loaded ...
    assert rss["peak"] - rss["loaded"] < 0.25 * scale * weights_kib, rss
    # ... and what stays loaded is the weights once (not, say, the file's pages mapped beside a packed copy).
    assert rss["peak"] - rss["before"] < 1.25 * scale * weights_kib, rss


def test_reader_matches_safetensors(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16),
               "f16": torch.randn(2, 2, 2).half(), "i64": torch.arange(4), "scalar": torch.tensor(1.5),
               "empty": torch.empty(0, 3), "flag": torch.tensor([True, False])}
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    ours = dict(read_safetensors(path))
    expected = load_file(path)
    assert ours.keys() == expected.keys()
    for name, t in expected.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


def test_reader_errors_are_clear(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_file({"a": torch.randn(64)}, path)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-8])
    with pytest.raises(ValueError, match="truncated: tensor 'a'"):
        list(read_safetensors(path))
    with open(path, "wb") as f:
        f.write(b"\x05\x00")
    with pytest.raises(ValueError, match="not a safetensors file"):
        list(read_safetensors(path))
    header = json.dumps({"a": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + b"\x00")
    with pytest.raises(ValueError, match="unsupported dtype 'F8_E4M3'"):
        list(read_safetensors(path))
