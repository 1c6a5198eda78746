"""Weight-only quantization (kernels/quant.py, cpu_quant.c): the formats' packing round trips, the quantized
tile matmul against a float64 reference of the dequantized weights, and engines started with --quantization
against float engines built from the dequantized weights.

Tolerance of the kernel, from its arithmetic. Where it dequantizes to bf16 (more than 16 rows, or int8 groups of
16): each weight is rounded to bf16 (relative error at most 2^-9), products of bf16 values are summed in fp32 (a
few fp32 ulps of S, the sum of the products' magnitudes) and the output is rounded to bf16 once (at most 2^-9 of
its magnitude, itself at most S): |y - y64| <= 2^-8 S; there it is also checked bit for bit against the bf16 tile
linear on the bf16-rounded dequantized weights, which is what it computes. Up to 16 rows with groups of 32 or more
it sums inputs times the integer values exactly in fp32 and scales each group's sum in fp32, so only the output's
bf16 rounding and fp32 ulps remain, within the same bound."""
from __future__ import annotations

import contextlib
import json
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from radixserve.kernels import native, quant, quant_linear
from radixserve.kernels.layers import Linear
from radixserve.kernels.quant_spec import parse_quantization
from radixserve.scheduler import Engine, SamplingParams

from _engine_helpers import hf_logprobs, hf_model, make_checkpoint

TILES = native.cannot_build() is None and native.tiles_ready()
KERNEL = native.cannot_build() is None and quant_linear.kernel() is not None
VEC = native.cannot_build() is None and native.load() is not None and native._use_dpbf16()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs the native library")


def _quantized(kind: str, w: torch.Tensor, group: int, half: bool = True) -> quant.QuantWeight:
    """The quantizer's weight (fp16 scales), or with `half` False the same with fp32 scales (the other format)."""
    qw = quant.quantize_int8(w, group) if kind == "int8" else quant.quantize_int4(w, group)
    assert qw.scales.dtype == torch.float16
    if half:
        return qw
    return quant.QuantWeight(kind, qw.q, qw.scales.float(), None if qw.mins is None else qw.mins.float(), group)


def _on(path: str):
    """Runs quant_linear.linear on `path` ("tiles", "vec": tiles refused even where they run, "f32": both refused)."""
    stack = contextlib.ExitStack()
    if path in ("vec", "f32"):
        stack.enter_context(mock.patch.object(native, "tiles_ready", lambda: False))
    if path == "f32":
        stack.enter_context(mock.patch.object(native, "_use_dpbf16", lambda: False))
    return stack


PATHS = [p for p, ok in (("tiles", TILES), ("vec", VEC), ("f32", KERNEL)) if ok]


def _check(got: torch.Tensor, x: torch.Tensor, qw: quant.QuantWeight, b: torch.Tensor | None) -> None:
    w = qw.dequantize().double()
    bias = None if b is None else b.double()
    exact = torch.nn.functional.linear(x.double(), w, bias)
    magnitude = torch.nn.functional.linear(x.double().abs(), w.abs(), None if b is None else bias.abs())
    assert got.shape == exact.shape
    assert ((got.double() - exact).abs() <= magnitude * 2**-8 + 1e-30).all()


def _check_f32(got: torch.Tensor, x: torch.Tensor, qw: quant.QuantWeight, b: torch.Tensor | None) -> None:
    """The fp32 kernel's bound: fp32 sums of K products, each weight exact or rounded once, so |y - y64| <=
    (K + 4) 2^-24 S, with S the sum of |x| times |q scale| + |min| (one row scales a group's sums of the values, whose
    terms may cancel: |q scale| and |min| may each exceed |w|) and |bias|."""
    q, k = qw.q.double(), qw.q.shape[1]
    scales = qw.scales.double().repeat_interleave(qw.group, dim=1)
    mins = 0 if qw.mins is None else qw.mins.double().repeat_interleave(qw.group, dim=1)
    bias = None if b is None else b.double()
    exact = torch.nn.functional.linear(x.double(), qw.dequantize().double(), bias)
    terms = (q * scales).abs() + (mins.abs() if qw.mins is not None else 0)
    magnitude = torch.nn.functional.linear(x.double().abs(), terms, None if b is None else bias.abs())
    assert got.shape == exact.shape
    assert ((got.double() - exact).abs() <= magnitude * (k + 4) * 2**-24 + 1e-30).all()


kinds_and_groups = st.sampled_from([("int8", 16), ("int8", 32), ("int8", 128), ("int8", 0), ("int4", 32),
                                    ("int4", 128)])


@needs_kernel
@settings(max_examples=80, deadline=None)
@given(kg=kinds_and_groups, m=st.integers(1, 64), blocks=st.integers(1, 9), kb=st.integers(1, 6),
       bias=st.booleans(), threads=st.sampled_from([1, 2]), half=st.booleans(), path=st.sampled_from(PATHS or ["-"]),
       seed=st.integers(0, 2**16))
def test_quantized_matmul_matches_float64(kg, m, blocks, kb, bias, threads, half, path, seed):
    """Rows 1-64 (one 16-row tile, or the panel path from 17 rows on; without tiles the vdpbf16ps rows up to 16,
    the dequantized bf16 matmul past), column counts leaving a partial group of four blocks, reductions of 1-6 groups
    (group 0: one per output channel), fp16 and fp32 scales, on each kernel this CPU runs."""
    kind, group = kg
    gen = torch.Generator().manual_seed(seed)
    n, k = 16 * blocks, max(32, group) * kb
    qw = _quantized(kind, torch.randn(n, k, generator=gen), group or k, half)
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    torch.set_num_threads(threads)
    try:
        with _on(path):
            got = quant_linear.linear(x, quant.pack(qw), b)
        tiles = native.linear_tiles(x, native.pack_tiles(qw.dequantize().bfloat16()), b) if path == "tiles" else None
    finally:
        torch.set_num_threads(1)
    _check(got, x, qw, b)
    if tiles is not None and (m > 16 or group == 16):  # the dequantizing tile path
        assert torch.equal(got, tiles)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(kg=kinds_and_groups, m=st.integers(1, 40), blocks=st.integers(1, 5), kb=st.integers(1, 6),
       bias=st.booleans(), threads=st.sampled_from([1, 2]), half=st.booleans(), seed=st.integers(0, 2**16))
def test_fp32_activations_are_summed_in_fp32(kg, m, blocks, kb, bias, threads, half, seed):
    """fp32 x takes the fp32 kernel on every CPU (cpu_quant_f32.c): up to 16 rows on the packed weights, more on
    column chunks dequantized to fp32 (one chunk of 32 columns here, so several); the result is the fp32 linear on
    the dequantized weights up to fp32 rounding of the sums: |y - y64| <= (K + 4) 2^-24 S, far inside bf16's."""
    kind, group = kg
    gen = torch.Generator().manual_seed(seed)
    n, k = 16 * blocks, max(32, group) * kb
    qw = _quantized(kind, torch.randn(n, k, generator=gen), group or k, half)
    x, b = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen) if bias else None
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(quant_linear, "DEQUANT_CHUNK_BYTES", 4 * k * 32):
            got = quant_linear.linear(x, quant.pack(qw), b)
    finally:
        torch.set_num_threads(1)
    assert quant_linear.kernel(torch.float32) == "fp32" and got.dtype == torch.float32
    _check_f32(got, x, qw, b)


@needs_kernel
@pytest.mark.parametrize("rows", [3, 20])
def test_fp32_kernel_widens_every_kind_of_fp16_scale(rows):
    """fp16 scales and mins of every finite class (normal, subnormal down to 2^-24, zero, either sign) widen exactly
    in the fp32 kernel (cpu_simd.h's vf_load_f16 works bit by bit where the CPU has no conversion instruction)."""
    gen = torch.Generator().manual_seed(3)
    n, k, group = 32, 128, 32
    classes = torch.tensor([1.0, -2.5, 6.1e-5, 3e-6, -5.96e-8, 0.0, 65504.0, 1e-3], dtype=torch.float16)
    scales = classes[torch.randint(0, 8, (n, k // group), generator=gen)]
    mins = -classes[torch.randint(0, 8, (n, k // group), generator=gen)]
    assert (scales.float().abs() < 6.1e-5).any() and (scales == 0).any()  # subnormals and zeros are in
    qw = quant.QuantWeight("int4", torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), scales, mins, group)
    x = torch.randn(rows, k, generator=gen)
    _check_f32(quant_linear.linear(x, quant.pack(qw), None), x, qw, None)


@needs_kernel
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prefill_rows_and_long_rows(kind, monkeypatch):
    """Hundreds of rows (the dequantized panel, rows in pairs of tiles; without tiles, column chunks of the
    dequantized bf16 weights, the last one short) and K past one panel of four blocks."""
    gen = torch.Generator().manual_seed(5)
    qw = _quantized(kind, torch.randn(80, 4864, generator=gen), 32)
    x = torch.randn(300, 4864, generator=gen).bfloat16()
    monkeypatch.setattr(quant_linear, "DEQUANT_CHUNK_BYTES", 2 * 4864 * 48)
    got = quant_linear.linear(x, quant.pack(qw), None)
    _check(got, x, qw, None)
    if TILES:
        assert torch.equal(got, native.linear_tiles(x, native.pack_tiles(qw.dequantize().bfloat16()), None))


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [20, 3])
def test_a_wrong_scale_column_or_row_would_show(rows, path):
    """Many rows (the dequantizing paths) and a few (the values-then-scale paths), on each kernel this CPU runs."""
    gen = torch.Generator().manual_seed(1)
    qw = quant.quantize_int4(torch.randn(48, 64, generator=gen), 32)
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    with _on(path):
        got = quant_linear.linear(x, quant.pack(qw), None)
    _check(got, x, qw, None)
    with pytest.raises(AssertionError):
        _check(got[:, [1, 0, *range(2, 48)]], x, qw, None)
    with pytest.raises(AssertionError):
        _check(got[[rows - 1, *range(1, rows - 1), 0]], x, qw, None)
    for swapped in (quant.QuantWeight("int4", qw.q, qw.scales.flip(1).contiguous(), qw.mins, 32),
                    quant.QuantWeight("int4", qw.q, qw.scales, qw.mins.flip(1).contiguous(), 32)):
        with pytest.raises(AssertionError), _on(path):
            _check(quant_linear.linear(x, quant.pack(swapped), None), x, qw, None)


@settings(max_examples=40, deadline=None)
@given(kg=kinds_and_groups, blocks=st.integers(1, 4), kb=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_packing_round_trips(kg, blocks, kb, seed):
    kind, group = kg
    gen = torch.Generator().manual_seed(seed)
    n, k = 16 * blocks, max(32, group) * kb
    group = group or k
    if kind == "int8":
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        packed = quant.pack_int8(q, torch.rand(n, k // group, generator=gen), group)
    else:
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        packed = quant.pack_int4(q, torch.rand(n, k // group, generator=gen), torch.randn(n, k // group), group)
    back = packed.unpack()
    assert torch.equal(back.q, q) and back.group == group
    assert packed.nbytes == n * k // (1 if kind == "int8" else 2) + n * k // group * 4 * (1 if kind == "int8" else 2)
    again = quant.pack(back)
    assert all(torch.equal(a, b) for a, b in ((again.data, packed.data), (again.scales, packed.scales)))


@settings(max_examples=30, deadline=None)
@given(kg=kinds_and_groups, seed=st.integers(0, 2**16))
def test_quantize_rounds_to_the_nearest_level(kg, seed):
    kind, group = kg
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(seed))
    qw = _quantized(kind, w, group or 256)
    step = qw.scales.float().repeat_interleave(qw.group, dim=1)  # fp16 arithmetic would drop the slack
    assert ((qw.dequantize() - w).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()


def test_bad_formats_are_clear_errors():
    q8, q4 = torch.zeros(16, 64, dtype=torch.int8), torch.zeros(16, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group 48"):
        quant.pack_int8(q8, torch.ones(16, 1), 48)
    with pytest.raises(ValueError, match="scales must be float16 or float32"):
        quant.pack_int8(q8, torch.ones(16, 3), 32)
    with pytest.raises(ValueError, match="0..15"):
        quant.pack_int4(q4 + 16, torch.ones(16, 2), torch.zeros(16, 2), 32)
    with pytest.raises(ValueError, match="int8 weights take no mins"):
        quant.QuantWeight("int8", q8, torch.ones(16, 2), torch.ones(16, 2), 32)
    with pytest.raises(ValueError, match="N a multiple of 16"):
        quant.pack(quant.quantize_int8(torch.randn(24, 64)))
    with pytest.raises(ValueError, match="quantization must be one of"):
        parse_quantization("int3")
    assert parse_quantization("int4-g128") == parse_quantization("int4-g128") and parse_quantization("none") is None


def test_linear_falls_back_to_dequantized_float_without_a_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    qw = quant.quantize_int8(torch.randn(32, 64, generator=gen), 32)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    monkeypatch.setattr(quant_linear, "kernel", lambda dtype=None: None)  # no native library
    layer = Linear(qw, None)
    assert layer.quant is not None and layer.weight is None
    _check(layer(x), x, qw, None)


# Engines: a tiny random checkpoint served quantized against the float engine of its dequantized weights.

def _dequantized_copy(src: str, dst: str, name: str) -> None:
    """src with every weight the loader would quantize replaced by its dequantization (float32), and a tied
    head untied to the dequantized quantized embedding, as the quantized engine's head is (quantized from the
    embedding as loaded, in the engine's bf16)."""
    os.makedirs(dst)
    spec = parse_quantization(name)
    transform = quant.load_transform(spec)
    state = load_file(os.path.join(src, "model.safetensors"))
    out = {n: (t if isinstance(q := transform(n, t), torch.Tensor) else q.dequantize()) for n, t in state.items()}
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = quant.quantize(state["model.embed_tokens.weight"].bfloat16(), spec).dequantize()
        config["tie_word_embeddings"] = False
    save_file({n: t.contiguous() for n, t in out.items()}, os.path.join(dst, "model.safetensors"))
    for entry in os.listdir(src):
        if entry not in ("model.safetensors", "config.json"):
            with open(os.path.join(src, entry), "rb") as f, open(os.path.join(dst, entry), "wb") as g:
                g.write(f.read())
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory, "quant-tiny", "qwen2", hidden_size=128, intermediate_size=256,
                           num_heads=4, num_kv_heads=2, tie_word_embeddings=True, initializer_range=0.2)


GAP = 0.5  # a position is decisive where the reference's top-1 logprob leads the second by more than this


def _faithfulness(reference, prompts, results) -> tuple[int, float]:
    """Teacher-forced through the float32 reference: the decisive positions (each asserted to pick the
    reference's top-1) and the largest error of a chosen token's logprob."""
    decisive = worst = 0
    for prompt, result in zip(prompts, results):
        rows = hf_logprobs(reference, prompt + result.output_ids)[len(prompt) - 1:-1]
        for tok, row, ours in zip(result.output_ids, rows, result.logprobs):
            top2 = row.topk(2).values
            if float(top2[0] - top2[1]) > GAP:
                decisive += 1
                assert tok == int(row.argmax())
            worst = max(worst, abs(ours.logprob - float(row[tok])))
    return decisive, worst


@needs_kernel
@pytest.mark.parametrize("name", ["int8", "int4", "int4-g128"])
def test_engine_matches_the_float_model_of_its_dequantized_weights(tiny, tmp_path, name):
    """The quantized engine's greedy tokens, teacher-forced through transformers' float32 forward of the
    dequantized checkpoint: the same top-1 wherever it is decisive, and its logprobs no further from it than
    those of the bf16 engine on the dequantized checkpoint (plus 0.02: the quantized engine's linears round
    differently). Prompts of 5-25 tokens: prefills on both paths of the kernel, then batched decodes."""
    prompts = [[5 + i, 40 + 3 * i, 7, 90 + i, 11] * (1 + i) for i in range(5)]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    engine = Engine(tiny, dtype="bfloat16", quantization=name, num_threads=1, kv_cache_tokens=1024)
    layers = [engine.runner.model.lm_head, *(lin for layer in engine.runner.model.layers
                                             for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    assert all(lin.quant is not None for lin in layers)
    results = engine.generate(prompts, params)
    engine.shutdown()
    deq = str(tmp_path / "deq")
    _dequantized_copy(tiny, deq, name)
    bf16 = Engine(deq, dtype="bfloat16", num_threads=1, kv_cache_tokens=1024)
    baseline = bf16.generate(prompts, params)
    bf16.shutdown()
    reference = hf_model(deq)
    decisive, worst = _faithfulness(reference, prompts, results)
    _, worst_bf16 = _faithfulness(reference, prompts, baseline)
    assert decisive >= 20 and worst <= worst_bf16 + 0.02, (decisive, worst, worst_bf16)


def test_quantization_is_refused_off_the_cpu(tiny):
    from radixserve.kernels.runner import ModelRunner

    with pytest.raises(ValueError, match="runs on the CPU only"):
        ModelRunner(tiny, num_slots=64, device="cuda", quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(tiny, quantization="int2")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantizing_in_row_blocks_changes_nothing(monkeypatch, kind):
    w = torch.randn(100, 256, generator=torch.Generator().manual_seed(4))
    whole = _quantized(kind, w, 32)
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 256 * 7)  # blocks of 7 rows, the last one short
    blocks = _quantized(kind, w, 32)
    assert all(torch.equal(a, b) for a, b in ((whole.q, blocks.q), (whole.scales, blocks.scales)))
    assert whole.mins is None or torch.equal(whole.mins, blocks.mins)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_lookup_dequantizes_the_rows_it_gathers(kind):
    """An embedding table kept quantized: the rows looked up equal those of the whole dequantized weight."""
    gen = torch.Generator().manual_seed(6)
    qw = _quantized(kind, torch.randn(64, 96, generator=gen), 32)
    ids = torch.tensor([5, 0, 63, 17, 5, 31])
    got = quant.pack(qw).lookup(ids, torch.float32)
    assert torch.equal(got, qw.dequantize()[ids])
    assert torch.equal(quant.pack(qw).lookup(ids[:2], torch.bfloat16), qw.dequantize()[ids[:2]].bfloat16())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_scales_are_fp16_unless_out_of_its_range(kind):
    """fp16 scales (and mins): 1 bit per weight at group 32 for int4's pair, against 2 in fp32; weights past fp16's
    range keep fp32 scales (the whole tensor, every row block alike), and both still round to the nearest level."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    small, big = _quantized(kind, w, 32), quant.quantize_int8(w * 1e7, 32) if kind == "int8" else \
        quant.quantize_int4(w * 1e7, 32)
    assert small.scales.dtype == torch.float16 and big.scales.dtype == torch.float32
    values, tables = (32 * 64, 1) if kind == "int8" else (32 * 64 // 2, 2)  # bytes; scales (and mins)
    assert quant.pack(small).nbytes == values + tables * 32 * 2 * 2
    for qw, scale in ((small, 1), (big, 1e7)):
        step = qw.scales.float().repeat_interleave(32, dim=1)
        assert ((qw.dequantize() - w * scale).abs() <= step / 2 * (1 + 1e-5) + 1e-6 * scale).all()


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_a_fusion_of_formats_is_a_stack_of_its_runs(rows, path):
    """cat_rows keeps parts in different formats quantized (a Q4_K_M file's Q6_K v beside Q4_K q / k): one
    QuantWeight per run of one format, a QuantStack once packed, whose output is each run's beside the others'
    (bias split by rows), each within its kernel's bound; a run of parts in one format is one weight."""
    gen = torch.Generator().manual_seed(11)
    w = [torch.randn(n, 64, generator=gen) for n in (32, 16, 16, 48)]
    parts = [_quantized("int4", w[0], 32), _quantized("int4", w[1], 32), _quantized("int8", w[2], 16),
             _quantized("int4", w[3], 32)]
    runs = quant.cat_rows(parts)
    assert [(r.kind, r.shape[0]) for r in runs] == [("int4", 48), ("int8", 16), ("int4", 48)]
    assert isinstance(quant.cat_rows(parts[:2]), quant.QuantWeight)
    layer = Linear(quant.linear_weight(runs, torch.float32), torch.randn(112, generator=gen))
    assert isinstance(layer.quant, quant.QuantStack) and layer.quant.n == 112
    assert layer.quant.nbytes == sum(quant.pack(r).nbytes for r in runs)
    for dtype, check in ((torch.float32, _check_f32), (torch.bfloat16, _check)):  # bf16: the output rounded
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        with _on(path):
            got = layer(x).float()
        ends = [0, 48, 64, 112]
        for r, a, b in zip(runs, ends, ends[1:]):
            check(got[:, a:b], x.float(), r, layer.bias[a:b].to(dtype).float())
