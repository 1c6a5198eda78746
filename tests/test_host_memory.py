"""Freed host memory stays in the process (kernels/host_memory.py): a large activation freed by one
step is reused by the next instead of being faulted in again, and the engine turns it on for the CPU."""
from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap

import pytest

from _engine_helpers import make_checkpoint
import radixserve.kernels.runner as runner_mod
from radixserve.scheduler import Engine

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                                reason="mallopt thresholds are glibc's")

# A fresh process runs a layer-like pattern (a 64 MiB matmul output, a 32 MiB activation of it, both
# freed) 4 times a round, and prints the minor page faults of rounds 3 to 5 (the first rounds map the
# memory either way).
_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from radixserve.kernels.host_memory import retain_freed_memory
    if sys.argv[1] == "retain":
        assert retain_freed_memory()
    torch.set_num_threads(1)
    x, w = torch.randn(4096, 64), torch.randn(4096, 64)
    def round_():
        for _ in range(4):
            h = torch.nn.functional.linear(x, w)  # [4096, 4096] float32: 64 MiB
            g = torch.nn.functional.silu(h[:, :2048]) * h[:, 2048:]  # 32 MiB
            del h, g
    round_(); round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        round_()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_retained_memory_is_reused_without_page_faults():
    pages = 3 * 4 * (96 << 20) // 4096  # 3 rounds of 4 fresh mappings of 64 + 32 MiB
    assert _faults("default") > pages // 2  # glibc maps and unmaps blocks this large every time
    assert _faults("retain") < pages // 10  # kept in the heap: reused, no new pages to fault in


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "host_memory")


@pytest.mark.parametrize("release", [False, True])
def test_engine_retains_host_memory_on_the_cpu_unless_told(tiny_path, monkeypatch, release):
    calls = []
    monkeypatch.setattr(runner_mod, "retain_freed_memory", lambda: calls.append(1) or True)
    engine = Engine(tiny_path, device="cpu", kv_cache_tokens=64, num_threads=1, release_host_memory=release)
    try:
        assert calls == ([] if release else [1])
    finally:
        engine.shutdown()
