"""The native elementwise steps of a layer (kernels/cpu_pointwise.c through kernels/pointwise.py) against the torch
ops they replace (kernels/layers.py), on whatever build the machine makes, and the model forward with them on
and off."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels import layers, native, pointwise

pytestmark = pytest.mark.skipif(native.cannot_build() is not None, reason="needs the native library")

DTYPES = [torch.float32, torch.bfloat16]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable steps of the dtype separate a and b, elementwise (same sign assumed)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


def _close(got: torch.Tensor, want: torch.Tensor, share: float = 0.01, ulps: int = 1) -> None:
    """bf16: equal but for at most `ulps` on a small share (a sum in another order, exp's last bit before
    rounding); fp32: within a few ulps."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.bfloat16:
        apart = _ulps_apart(got, want)
        assert int(apart.max()) <= ulps, float(apart.max())
        assert float((apart > 0).float().mean()) <= share
    else:
        torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), d=st.sampled_from([16, 64, 96, 130, 896]), with_delta=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_add_rms_norm(rows, d, with_delta, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, d, generator=gen).to(dtype) if with_delta else None
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    x_native = x.clone()
    got = pointwise.add_rms_norm(x_native, delta, w, 1e-6)
    if delta is not None:
        x.add_(delta)
    assert torch.equal(x_native, x)  # the residual stream, in place, rounded as torch rounds
    # Rounded twice, as transformers does: x / rms to bf16, then x weight. The variance summed in another order
    # can tip the first rounding at a tie by one ulp, which the weight (up to 1.5) makes two at the output
    # (rows=20, d=896, bf16, seed=51: 1.7656 or 1.7734 before the weight, 1.9141 or 1.9297 after).
    _close(got, layers.rms_norm(x, w, 1e-6), ulps=2)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), heads=st.integers(1, 6), head_dim=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rotary_in_place(rows, heads, head_dim, dtype, seed):
    """The first `heads` heads of wider rows (q and k inside the qkv output), the rest untouched."""
    gen = torch.Generator().manual_seed(seed)
    rotary = layers.RotaryEmbedding(head_dim, _rope(), "cpu")
    positions = torch.randint(0, 5000, (rows,), generator=gen)
    qkv = torch.randn(rows, (heads + 1) * head_dim, generator=gen).to(dtype)
    want = layers.apply_rotary(qkv[:, :heads * head_dim].reshape(rows, heads, head_dim),
                               rotary.rotation(positions, dtype)).reshape(rows, -1)
    got = qkv.clone()
    pointwise.rotary_(got, heads, head_dim, *rotary.cos_sin(positions, dtype))
    assert torch.equal(got[:, heads * head_dim:], qkv[:, heads * head_dim:])
    if dtype == torch.bfloat16:
        assert torch.equal(got[:, :heads * head_dim], want)  # the same roundings in the same order
    else:
        torch.testing.assert_close(got[:, :heads * head_dim], want, rtol=1e-5, atol=1e-5)


def _rope():
    from radixserve.kernels.model_config import RopeConfig
    return RopeConfig(rope_type="default", rope_theta=10000.0)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), inter=st.sampled_from([16, 48, 100, 4864]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_silu_and_mul(rows, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    _close(pointwise.silu_and_mul(gate_up), layers.silu_and_mul(gate_up.clone()))


def test_silu_saturates_without_nan():
    """exp's argument clamped: huge gates give silu(g) = g or 0, never NaN or inf from the approximation."""
    gate_up = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got = pointwise.silu_and_mul(gate_up)
    torch.testing.assert_close(got, layers.silu_and_mul(gate_up.clone()), rtol=1e-6, atol=1e-30)


def test_a_wrong_rounding_or_head_would_show():
    """The comparisons are sharp: a norm without the bf16 rounding before the weight, or a rotation of the
    wrong pair, fails them."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(8, 896, generator=gen) * 3).bfloat16()
    w = (torch.rand(896, generator=gen) + 0.5).bfloat16()
    once = (w.float() * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))).bfloat16()
    with pytest.raises(AssertionError):
        _close(once, layers.rms_norm(x, w, 1e-6), ulps=2)  # as sharp as test_add_rms_norm's comparison
    rotary = layers.RotaryEmbedding(64, _rope(), "cpu")
    positions = torch.arange(8) * 37
    qkv = torch.randn(8, 128, generator=gen).bfloat16()
    got = qkv.clone()
    pointwise.rotary_(got, 2, 64, *rotary.cos_sin(positions, torch.bfloat16))
    swapped = layers.apply_rotary(qkv.view(8, 2, 64)[:, :, [1, 0, *range(2, 64)]],
                                  rotary.rotation(positions, torch.bfloat16)).reshape(8, -1)
    assert not torch.equal(got, swapped)
