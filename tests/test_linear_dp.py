"""The vdpbf16ps linear over the AMX tile layout (kernels/cpu_linear_dp.c through native.linear_tiles(dp=True))
against float64 torch, and the model's Linear taking it on a CPU with AVX512-BF16 but no AMX. Runs where the
CPU has AVX512-BF16 and the library is the AVX-512 build; the AVX2 and portable builds are checked to leave it
out (oneDNN serves the bf16 linears there)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels import layers, native

from _linear_reference import check_bf16_linear as _check

pytestmark = pytest.mark.skipif(native.cannot_build() is not None or not native._use_dpbf16(),
                                reason="needs the native AVX-512 library on a CPU with AVX512-BF16")


def _run(m: int, n: int, k: int, bias: bool, threads: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    torch.set_num_threads(threads)
    try:
        got = native.linear_tiles(x, native.pack_tiles(w), b, dp=True)
    finally:
        torch.set_num_threads(1)
    _check(got, x, w, b)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), blocks=st.integers(1, 9), kb=st.integers(1, 12), bias=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_matches_float64(m, blocks, kb, bias, threads, seed):
    """Row counts across the 8-row micro-kernel's groups and tails, column counts that leave a partial group of
    three 16-column blocks, reductions of 1-12 steps of 32 inputs."""
    _run(m, 16 * blocks, 32 * kb, bias, threads, seed)


@pytest.mark.parametrize("m, k", [(100, 4864), (300, 896)])
def test_input_chunks_and_row_blocks(m, k):
    """Model L's down projection width: 1,024-input chunks (the last partial) whose partial sums wait in the
    buffer, 48-row blocks; and more rows than one 256-row block holds at a narrow width."""
    _run(m, 80, k, True, 2, 7)


def test_a_wrong_column_row_or_pair_would_show():
    """The comparison is sharp enough to catch swapped columns or rows, or an input pair read in reverse."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 64, generator=gen).bfloat16(), torch.randn(48, 64, generator=gen).bfloat16()
    got = native.linear_tiles(x, native.pack_tiles(w), None, dp=True)
    _check(got, x, w, None)
    with pytest.raises(AssertionError):
        _check(got[:, [1, 0, *range(2, 48)]], x, w, None)
    with pytest.raises(AssertionError):
        _check(got[[7, *range(1, 7), 0, *range(8, 20)]], x, w, None)
    swapped = x.view(20, 32, 2).flip(-1).reshape(20, 64)
    with pytest.raises(AssertionError):
        _check(native.linear_tiles(swapped, native.pack_tiles(w), None, dp=True), x, w, None)


def test_linear_takes_it_without_amx(monkeypatch):
    """Without AMX, a bf16 weight that tiles is packed once and every row count runs the vdpbf16ps kernel as it
    is (no padding to a row bucket); one that does not tile keeps oneDNN."""
    monkeypatch.setattr(native, "_use_amx", lambda: False)
    calls = []
    real = native.linear_tiles
    monkeypatch.setattr(native, "linear_tiles", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(3)
    tiled_w, odd_w = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen).bfloat16()
    tiled, odd = layers.Linear(tiled_w, None), layers.Linear(odd_w, None)
    assert tiled.tiles is not None and tiled.packed is None and tiled.weight is None
    assert odd.tiles is None
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        _check(tiled(x), x, tiled_w, None)
        _check(odd(x), x, odd_w, None)
    assert calls == [1, 7, 33]


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_other_builds_leave_it_out(monkeypatch, isa):
    """The AVX2 and portable builds have no vdpbf16ps kernel (it answers -1): Linear packs for oneDNN there."""
    monkeypatch.setenv(native.ISA_ENV, isa)
    native.reset()
    try:
        assert native.status() == f"native {isa}"
        w = torch.randn(32, 64).bfloat16()
        out = torch.empty(1, 32, dtype=torch.bfloat16)
        assert native.load().rs_linear_dp(w.data_ptr(), 1, w.data_ptr(), 32, 64, None, out.data_ptr(), 1) == -1
        assert not native.tiles_supported(w)
        linear = layers.Linear(w, None)
        assert linear.tiles is None
        x = torch.randn(3, 64).bfloat16()
        _check(linear(x), x, w, None)
    finally:
        monkeypatch.delenv(native.ISA_ENV)
        native.reset()
