"""bench/attn_micro.py on tiny shapes: every case runs through the native kernel and reports its time."""
from __future__ import annotations

import pytest
import torch

from _native_readers import NEEDS_NATIVE
from radixserve.bench import attn_micro
from radixserve.kernels import native

pytestmark = NEEDS_NATIVE


@pytest.mark.parametrize("extra", [[], ["--widen"], ["--dtype", "fp32"]])
def test_every_case_reports(capsys, monkeypatch, extra):
    monkeypatch.setattr(native, "_products", native._products)  # --widen replaces it
    threads = torch.get_num_threads()
    try:
        attn_micro.main(["--prefix", "300", "--batch", "3", "--suffix", "5", "--own", "9", "--reps", "1",
                         "--threads", "1", *extra])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("native ")
    assert [line.split()[0] for line in lines[1:]] == ["decode_shared", "decode_own", "prefill_causal",
                                                        "prefill_shared"]
    assert all(float(line.split()[2]) > 0 for line in lines[1:])
