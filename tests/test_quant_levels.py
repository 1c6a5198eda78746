"""Two-level scales (kernels/quant_levels.py): GGUF K-quants' fp16 factors times int8 sub-scales, kept as the file
stores them. A two-level weight stands for exactly the one-level weight of its products (QuantWeight.one_level), so
every kernel that reads it (cpu_quant_f32.c, cpu_quant_i8.c) must give bit for bit the results it gives on that
one-level weight: any misplaced factor or sub-scale shows. The GGUF mapping's side is tests/test_gguf.py's."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels import native, quant, quant_act, quant_levels

KERNEL = native.cannot_build() is None and native.load() is not None
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs the native library")


def two_level(kind: str, n: int, k: int, group: int, seed: int) -> quant.QuantWeight:
    """A random two-level weight: Q6_K-like (int8, signed sub-scales) or Q4_K-like (int4, sub-scales and mins
    0..63, negative min factors), fp16 factors of a few magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    groups, supers = k // group, k // quant_levels.SUPER
    factor = lambda: (torch.randn(n, supers, generator=gen) * 2.0 ** torch.randint(-12, -4, (n, supers), generator=gen)).half()  # noqa: E731
    if kind == "int8":
        q = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
        return quant.QuantWeight("int8", q, torch.randint(-128, 128, (n, groups), generator=gen, dtype=torch.int8),
                                 None, group, factor())
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    sub = lambda: torch.randint(0, 64, (n, groups), generator=gen, dtype=torch.int8)  # noqa: E731
    return quant.QuantWeight("int4", q, sub(), sub(), group, factor().abs(), -factor().abs())


kinds_and_groups = st.sampled_from([("int8", 16), ("int8", 32), ("int8", 256), ("int4", 32), ("int4", 64),
                                    ("int4", 256)])


@settings(max_examples=40, deadline=None)
@given(kg=kinds_and_groups, blocks=st.integers(1, 4), supers=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_packing_round_trips_and_lookups_read_the_products(kg, blocks, supers, seed):
    kind, group = kg
    w = two_level(kind, 16 * blocks, quant_levels.SUPER * supers, group, seed)
    packed = quant.pack(w)
    assert packed.two_level and packed.flags & 4 and packed.scales.dtype == torch.uint8
    back = packed.unpack()
    for name in ("q", "scales", "mins", "super_scales", "super_mins"):
        a, b = getattr(w, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    one = w.one_level()
    assert one.scales.dtype == torch.float32 and torch.equal(w.dequantize(), one.dequantize())
    ids = torch.randint(0, w.shape[0], (7,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(packed.lookup(ids, torch.float32), one.dequantize()[ids])
    # scales and mins together: 2 (1) bytes per group and 2 (4) per SUPER inputs of a column, against 4 (8) per group
    per_column = (1 + (kind == "int4")) * (w.shape[1] // group + 2 * supers)
    assert packed.nbytes == w.q.numel() // (2 if kind == "int4" else 1) + per_column * w.shape[0]


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(kg=kinds_and_groups, m=st.sampled_from([1, 2, 3, 16, 20]), blocks=st.integers(1, 3),
       supers=st.integers(1, 3), bias=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_kernels_give_the_one_level_results_bit_for_bit(kg, m, blocks, supers, bias, threads, seed):
    """cpu_quant_f32.c (1 row, up to 16, more by dequantized column chunks) and, where it runs, cpu_quant_i8.c on the
    two-level weight equal themselves on its one-level products; bf16 activations take the fp32 kernel."""
    kind, group = kg
    w = two_level(kind, 16 * blocks, quant_levels.SUPER * supers, group, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, w.shape[1], generator=gen)
    b = torch.randn(w.shape[0], generator=gen) if bias else None
    two, one = quant.pack(w), quant.pack(w.one_level())
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(quant.linear(x, two, b), quant.linear(x, one, b))
        assert torch.equal(quant.linear(x.bfloat16(), two, b), quant._linear_f32(x.bfloat16(), one, b).bfloat16())
        if quant_act.ready() and m <= 16:
            assert torch.equal(quant.linear_int8(x, two, b), quant.linear_int8(x, one, b))
    finally:
        torch.set_num_threads(prev)
    exact = torch.nn.functional.linear(x.double(), w.dequantize().double(), None if b is None else b.double())
    assert (quant.linear(x, two, b).double() - exact).abs().max() < 1e-3 * exact.abs().max()


def test_bad_two_level_weights_are_clear_errors():
    w = two_level("int4", 16, 512, 32, 0)
    with pytest.raises(ValueError, match="two-level scales need K a multiple of 256"):
        quant.QuantWeight("int4", w.q[:, :480], w.scales[:, :15], w.mins[:, :15], 32, w.super_scales,
                          w.super_mins)
    with pytest.raises(ValueError, match="int4 weights need super_mins"):
        quant.QuantWeight("int4", w.q, w.scales, w.mins, 32, w.super_scales, None)
    with pytest.raises(ValueError, match=r"super_scales must be float16 \[16, 2\]"):
        quant.QuantWeight("int4", w.q, w.scales, w.mins, 32, w.super_scales.float(), w.super_mins)
    with pytest.raises(ValueError, match=r"scales must be int8"):
        quant.QuantWeight("int4", w.q, w.scales.float(), w.mins, 32, w.super_scales, w.super_mins)
    with pytest.raises(ValueError, match="one kind, group and scale levels"):
        quant.QuantWeight.cat([w, w.one_level()])
    assert [p.two_level for p in quant.cat_rows([w, w.one_level(), w])] == [True, False, True]


@needs_kernel
def test_the_bf16_kernels_refuse_two_level_scales():
    """quant.linear sends two-level weights to the fp32 kernel; the bf16 ones (AMX tiles, AVX512-BF16) refuse them
    rather than read a blob as scales (every build exports them: they return -1 where they cannot run at all)."""
    w = quant.pack(two_level("int4", 16, 256, 32, 1))
    x = torch.randn(1, 256).bfloat16()
    y = torch.empty(1, 16, dtype=torch.bfloat16)
    lib = native.load()
    for fn in (lib.rs_linear_quant, lib.rs_quant_rows):
        assert fn(x.data_ptr(), 1, w.flags, w.data.data_ptr(), w.scales.data_ptr(), w.mins.data_ptr(), 16, 256, 32,
                  None, y.data_ptr(), 1) == -1
