"""The AMX tile linear (kernels/cpu_linear_amx.c through native.linear_tiles) against float64 torch, and the
model's Linear taking it for every bf16 weight whose shape tiles. Runs where the CPU has AMX-BF16 (this
project's machines do); elsewhere the path is never taken and the tests skip."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels import layers, native

from _linear_reference import check_bf16_linear as _check

pytestmark = pytest.mark.skipif(native.cannot_build() is not None or not native._use_amx(),
                                reason="needs the native library and AMX-BF16 tiles")


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 70), blocks=st.integers(1, 9), kb=st.integers(1, 12), bias=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_matches_float64(m, blocks, kb, bias, threads, seed):
    """Row counts on both sides of the 16- and 32-row tiles (and their tails), column counts that leave a
    partial group of four 16-column blocks, reductions of 1-12 tile widths."""
    gen = torch.Generator().manual_seed(seed)
    n, k = 16 * blocks, 32 * kb
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    torch.set_num_threads(threads)
    try:
        got = native.linear_tiles(x, native.pack_tiles(w), b)
    finally:
        torch.set_num_threads(1)
    _check(got, x, w, b)


def test_a_wrong_column_or_row_would_show():
    """The comparison is sharp enough to catch swapped columns or rows."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(20, 64, generator=gen).bfloat16(), torch.randn(48, 64, generator=gen).bfloat16()
    got = native.linear_tiles(x, native.pack_tiles(w), None)
    _check(got, x, w, None)
    with pytest.raises(AssertionError):
        _check(got[:, [1, 0, *range(2, 48)]], x, w, None)
    with pytest.raises(AssertionError):
        _check(got[[17, *range(1, 17), 0, 18, 19]], x, w, None)


def test_linear_takes_tiles_where_the_shape_tiles_and_onednn_elsewhere(monkeypatch):
    calls = []
    real = native.linear_tiles
    monkeypatch.setattr(native, "linear_tiles", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(3)
    tiled_w, odd_w = torch.randn(48, 64, generator=gen).bfloat16(), torch.randn(40, 64, generator=gen).bfloat16()
    tiled, odd = layers.Linear(tiled_w, None), layers.Linear(odd_w, None)
    assert tiled.tiles is not None and tiled.packed is None and tiled.weight is None and tiled.is_packed
    assert odd.tiles is None
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        _check(tiled(x), x, tiled_w, None)
        _check(odd(x), x, odd_w, None)
    assert calls == [1, 7, 33]
    assert layers.Linear(torch.randn(48, 64, generator=gen), None).tiles is None  # fp32 keeps oneDNN


def test_refuses_an_input_of_the_wrong_width():
    w = native.pack_tiles(torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="linear_tiles takes x"):
        native.linear_tiles(torch.zeros(2, 32, dtype=torch.bfloat16), w, None)
