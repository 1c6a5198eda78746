"""CPU matmuls run at a bounded set of row counts (kernels/layers.py ``row_bucket``): oneDNN compiles and
keeps a primitive for every row count it sees, so without buckets the engine's memory grew with every
new step size (a soak: 617 -> 1,229 MB in 3 minutes on the demo model)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels.layers import Linear, row_bucket


def test_row_buckets_are_few_cover_every_count_and_pad_little():
    buckets = {row_bucket(rows) for rows in range(1, 4097)}
    assert len(buckets) <= 56
    for rows in range(1, 20000):
        bucket = row_bucket(rows)
        assert bucket >= rows and row_bucket(bucket) == bucket
        if rows >= 128:
            assert bucket - rows <= rows / 8  # compute-bound sizes: at most 1/8 more work
    assert [row_bucket(r) for r in (1, 2, 3, 5, 9, 17, 33, 129, 257)] == [1, 2, 4, 8, 16, 32, 48, 144, 288]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 130, 300])
def test_padded_rows_do_not_change_the_result(dtype, rows):
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(rows, 64, dtype=dtype)
    got = Linear(weight, bias)(x)
    assert got.shape == (rows, 96)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.float(), F.linear(x, weight, bias).float(), atol=tol, rtol=tol)


# A fresh engine process on the demo model: one request at a time (each step has its own token count),
# prompt lengths 1-512, each with its own salt so that nothing is cached. Prints RSS (MB) after the first
# 16 and after all 512.
_RSS = textwrap.dedent("""
    import torch
    torch.set_num_threads(1)
    from radixserve.scheduler import Engine, SamplingParams

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    engine = Engine(None)
    marks = {}
    for n in range(1, 513):
        prompt = [(7 * i + n) % 200 + 10 for i in range(n)]
        engine.generate([prompt], dict(max_new_tokens=1, temperature=0, cache_salt=str(n)))
        if n in (16, 512):
            marks[n] = rss_mb()
    print(marks[16], marks[512])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_engine_memory_does_not_grow_with_the_step_sizes_it_has_seen():
    out = subprocess.run([sys.executable, "-c", _RSS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    after_16, after_512 = map(float, out.stdout.split()[-2:])
    # Measured: +72 MB with buckets (heap high-water of the largest step, 28 buckets' primitives),
    # +1,067 MB without.
    assert after_512 - after_16 < 100, (after_16, after_512)
