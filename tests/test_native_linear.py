"""The native bf16 linear (kernels/cpu_linear.c through native.linear_bf16) against float64 torch, once per
instruction-set build this CPU can run and, on AVX-512 with AVX512-BF16, with and without vdpbf16ps; and the
model's Linear taking it for the few rows of a decode step, with oneDNN for more."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels import layers, native

pytestmark = pytest.mark.skipif(native.cannot_build() is not None, reason=f"{native.cannot_build()}")


def _variants() -> list[tuple[str, bool]]:
    out = [(isa, False) for isa in native.runnable_isas()]
    if "avx512" in native.runnable_isas() and "avx512_bf16" in native.this_cpu_flags():
        out.insert(0, ("avx512", True))
    return out


@pytest.fixture(scope="module", params=_variants(), ids=lambda v: f"{v[0]}{'-dpbf16' if v[1] else ''}")
def variant(request):
    isa, use_dp = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ISA_ENV, isa)
        native.reset()
        mp.setattr(native, "_use_dpbf16", lambda: use_dp)
        assert native.status() == f"native {isa}"
        yield request.param
    native.reset()


def _bf16_ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of bf16's spacing at |exact| (one rounding of an fp32 sum is <= ~0.5-1)."""
    spacing = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return (got.double() - exact).abs() / spacing


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 70), k=st.integers(1, 200), bias=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_matches_float64(variant, m, n, k, bias, threads, seed):
    """Every row count a decode step sends, output columns that are not a multiple of the 4-row tile, and
    reduction lengths with tails of every size (the vector loops take 16 or 32 at a time)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    torch.set_num_threads(threads)
    try:
        got = native.linear_bf16(x, w, b)
    finally:
        torch.set_num_threads(1)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 sums of up to 200 products: a few fp32 ulps of the sum's magnitude, then one bf16 rounding.
    scale = torch.nn.functional.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    assert ((got.double() - exact).abs() <= scale * 2e-6 + exact.abs() * 2**-8 + 1e-30).all()


def test_a_wrong_row_or_column_would_show(variant):
    """The comparison above is sharp enough to catch one swapped output column."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(10, 64, generator=gen).bfloat16()
    got = native.linear_bf16(x, w, None)
    exact = torch.nn.functional.linear(x.double(), w.double())
    assert _bf16_ulps(got, exact).max() <= 1.0
    assert _bf16_ulps(got[:, [1, 0, *range(2, 10)]], exact).max() > 4


def test_an_unpacked_bf16_linear_takes_the_kernel_for_decode_rows_and_onednn_beyond(monkeypatch):
    """A weight kept as it is (a tied LM head) goes native up to NATIVE_MAX_ROWS rows, to F.linear beyond;
    a packed weight never goes native. Where nothing packs it (no AVX512-BF16 for the tiles and a oneDNN
    without bf16 on this CPU) a weight given to be packed is kept as it is, and goes like the head."""
    calls = []
    real = native.linear_bf16
    monkeypatch.setattr(native, "linear_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(48, 32, generator=gen).bfloat16(), torch.randn(48, generator=gen).bfloat16()
    head = layers.Linear(w, b, pack=False)
    assert head.packed is None and head.weight is w
    packed = layers.Linear(w, b)
    assert packed.is_packed != (packed.weight is w)
    decode_rows = [1, layers.NATIVE_MAX_ROWS]
    for layer, native_rows in ((head, decode_rows), (packed, [] if packed.is_packed else decode_rows)):
        calls.clear()
        for rows in (1, layers.NATIVE_MAX_ROWS, layers.NATIVE_MAX_ROWS + 1, 40):
            x = torch.randn(rows, 32, generator=gen).bfloat16()
            exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
            assert _bf16_ulps(layer(x), exact).max() <= 2.0
        assert calls == native_rows
