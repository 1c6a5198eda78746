"""The float64 reference the native bf16 linear kernels (AMX tiles, vdpbf16ps) are checked against."""
import torch


def check_bf16_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    # fp32 sums: a few fp32 ulps of the products' magnitude, then one bf16 rounding of the result.
    scale = torch.nn.functional.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    assert ((got.double() - exact).abs() <= scale * 2e-6 + exact.abs() * 2**-8 + 1e-30).all()
