"""The compact forms of quantized weights, which only the fp32 kernels read: two-level scales (kernels/quant_levels.py:
GGUF K-quants' fp16 factors times int8 sub-scales, as the file stores them) and symmetric int4 (no mins: -8 times
the scale, GGUF's Q4_0). A compact weight stands for exactly its expanded form (QuantWeight.expanded: one scale and
min per group, what every kernel reads), so cpu_quant_f32.c and cpu_quant_i8.c must give bit for bit on it what
they give on that form: any misplaced factor, sub-scale or implied min shows. The GGUF mapping's side is
tests/test_gguf.py's."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels import native, quant, quant_act, quant_levels, quant_linear

KERNEL = native.cannot_build() is None and native.load() is not None
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs the native library")


def compact(form: str, n: int, k: int, group: int, seed: int) -> quant.QuantWeight:
    """A random compact weight: "int8" two-level (Q6_K-like: signed sub-scales), "int4" two-level (Q4_K-like: sub-scales
    and mins 0..63, negative min factors), "sym" symmetric int4 with fp16 scales (Q4_0-like; "sym32": fp32 scales,
    "sym2": two-level), fp16 factors and scales of a few magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    groups, supers = k // group, k // quant_levels.SUPER
    factor = lambda cols: (torch.randn(n, cols, generator=gen)  # noqa: E731
                           * 2.0 ** torch.randint(-12, -4, (n, cols), generator=gen)).half()
    sub = lambda lo: torch.randint(lo, 64, (n, groups), generator=gen, dtype=torch.int8)  # noqa: E731
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if form == "int8":
        q = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
        return quant.QuantWeight("int8", q, sub(-64), None, group, factor(supers))
    if form == "int4":
        return quant.QuantWeight("int4", q4, sub(0), sub(0), group, factor(supers).abs(), -factor(supers).abs())
    if form == "sym2":
        return quant.QuantWeight("int4", q4, sub(-64), None, group, factor(supers))
    scales = factor(groups)
    return quant.QuantWeight("int4", q4, scales.float() if form == "sym32" else scales, None, group)


forms_and_groups = st.sampled_from([("int8", 16), ("int8", 32), ("int8", 256), ("int4", 32), ("int4", 64),
                                    ("int4", 256), ("sym", 32), ("sym", 128), ("sym32", 32), ("sym2", 32)])


@settings(max_examples=50, deadline=None)
@given(kg=forms_and_groups, blocks=st.integers(1, 4), supers=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_packing_round_trips_and_lookups_read_the_expanded_form(kg, blocks, supers, seed):
    form, group = kg
    w = compact(form, 16 * blocks, quant_levels.SUPER * supers, group, seed)
    packed = quant.pack(w)
    assert packed.compact and packed.two_level == w.two_level and packed.symmetric == w.symmetric
    assert packed.flags & 4 == 4 * w.two_level and packed.flags & 8 == 8 * w.symmetric
    back = packed.unpack()
    for name in ("q", "scales", "mins", "super_scales", "super_mins"):
        a, b = getattr(w, name), getattr(back, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    full = w.expanded()
    assert not (full.two_level or full.symmetric) and torch.equal(w.dequantize(), full.dequantize())
    ids = torch.randint(0, w.shape[0], (7,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(packed.lookup(ids, torch.float32), full.dequantize()[ids])
    # bytes per column: two-level 1 per group and 2 per SUPER inputs, for scales and (int4 with mins) mins; symmetric
    # its scales' 2 or 4 per group and no mins
    tables = 1 + (w.mins is not None)
    per_column = tables * (w.shape[1] // group + 2 * supers) if w.two_level else \
        w.scales.element_size() * w.shape[1] // group
    assert packed.nbytes == w.q.numel() // (2 if w.kind == "int4" else 1) + per_column * w.shape[0]


@needs_kernel
@settings(max_examples=50, deadline=None)
@given(kg=forms_and_groups, m=st.sampled_from([1, 2, 3, 16, 20]), blocks=st.integers(1, 3),
       supers=st.integers(1, 3), bias=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_kernels_give_the_expanded_forms_results_bit_for_bit(kg, m, blocks, supers, bias, threads, seed):
    """cpu_quant_f32.c (1 row, up to 16, more by dequantized column chunks) and, where it runs, cpu_quant_i8.c on the
    compact weight equal themselves on its expanded form; bf16 activations take the fp32 kernel."""
    form, group = kg
    w = compact(form, 16 * blocks, quant_levels.SUPER * supers, group, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, w.shape[1], generator=gen)
    b = torch.randn(w.shape[0], generator=gen) if bias else None
    small, full = quant.pack(w), quant.pack(w.expanded())
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(quant_linear.linear(x, small, b), quant_linear.linear(x, full, b))
        assert torch.equal(quant_linear.linear(x.bfloat16(), small, b), quant_linear._linear_f32(x.bfloat16(), full, b).bfloat16())
        if quant_act.ready() and m <= 16:
            assert torch.equal(quant_linear.linear_int8(x, small, b), quant_linear.linear_int8(x, full, b))
    finally:
        torch.set_num_threads(prev)
    exact = torch.nn.functional.linear(x.double(), w.dequantize().double(), None if b is None else b.double())
    assert (quant_linear.linear(x, small, b).double() - exact).abs().max() < 1e-3 * exact.abs().max()


def test_bad_compact_weights_are_clear_errors():
    w = compact("int4", 16, 512, 32, 0)
    with pytest.raises(ValueError, match="two-level scales need K a multiple of 256"):
        quant.QuantWeight("int4", w.q[:, :480], w.scales[:, :15], w.mins[:, :15], 32, w.super_scales,
                          w.super_mins)
    with pytest.raises(ValueError, match="int4 weights need super_mins"):
        quant.QuantWeight("int4", w.q, w.scales, w.mins, 32, w.super_scales, None)
    with pytest.raises(ValueError, match="int4 weights take no super_mins"):
        quant.QuantWeight("int4", w.q, w.scales, None, 32, w.super_scales, w.super_mins)
    with pytest.raises(ValueError, match=r"super_scales must be float16 \[16, 2\]"):
        quant.QuantWeight("int4", w.q, w.scales, w.mins, 32, w.super_scales.float(), w.super_mins)
    with pytest.raises(ValueError, match=r"scales must be int8"):
        quant.QuantWeight("int4", w.q, w.scales.float(), w.mins, 32, w.super_scales, w.super_mins)
    with pytest.raises(ValueError, match="one kind, group and scale levels"):
        quant.QuantWeight.cat([w, w.expanded()])
    sym = compact("sym", 16, 512, 32, 0)
    assert [p.format for p in quant.cat_rows([w, w.expanded(), w, sym, sym])] == [
        ("int4", 32, True, False), ("int4", 32, False, False), ("int4", 32, True, False), ("int4", 32, False, True)]
    big = quant.QuantWeight("int4", sym.q, torch.full_like(sym.scales, 8192.0), None, 32)  # -8 x 8192: past fp16
    assert big.expanded().mins.dtype == torch.float32 and big.expanded().scales.dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("form", ["int4", "sym"])
def test_the_bf16_kernels_refuse_the_compact_forms(form):
    """quant_linear.linear sends compact weights to the fp32 kernel; the bf16 ones (AMX tiles, AVX512-BF16) refuse them
    rather than read a blob as scales or miss the mins (every build exports them: they return -1 where they cannot
    run at all, so this checks the refusal only on CPUs where they run)."""
    w = quant.pack(compact(form, 16, 256, 32, 1))
    x = torch.randn(1, 256).bfloat16()
    y = torch.empty(1, 16, dtype=torch.bfloat16)
    lib = native.load()
    mins = None if w.mins is None else w.mins.data_ptr()
    for fn in (lib.rs_linear_quant, lib.rs_quant_rows):
        assert fn(x.data_ptr(), 1, w.flags, w.data.data_ptr(), w.scales.data_ptr(), mins, 16, 256, 32,
                  None, y.data_ptr(), 1) == -1
