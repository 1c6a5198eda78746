"""int8 activations for quantized linears at decode (kernels/quant_act.py, cpu_quant_i8.c): the kernel against a
float64 reference of its definition (each row quantized per block by quantize_activations, times the dequantized
weights), its rounding at ties, which calls take it, the setting's resolution, and a GGUF model on it.

Tolerance, from the arithmetic: the integer sums are exact; each block's is scaled by its d (one fp32 rounding),
the blocks of a group summed, scaled by the weight's scale and int4's min times the group's sum of x^ added, in
fp32 over the K / B blocks: |y - y64| <= (K + 4) 2^-24 S, S the sum of |x^| times |q scale| + |min| and |bias|."""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.bench.checkpoints.gguf_export import export_gguf
from radixserve.bench.checkpoints.random_weights import cached_checkpoint
from radixserve.kernels import ModelRunner, SeqInput, quant, quant_act, quant_linear
from radixserve.scheduler import EngineConfig

CPU = torch.device("cpu")
READY = quant_act.ready()
needs_int8 = pytest.mark.skipif(not READY, reason="needs the native library on x86-64 with AVX2, FMA and F16C")
TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            initializer_range=0.1)


def _weight(kind: str, n: int, k: int, group: int, half: bool, seed: int) -> quant.QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    qw = quant.quantize_int8(w, group) if kind == "int8" else quant.quantize_int4(w, group)
    if half:
        return qw
    return quant.QuantWeight(kind, qw.q, qw.scales.float(), None if qw.mins is None else qw.mins.float(), group)


def _check(got: torch.Tensor, x: torch.Tensor, qw: quant.QuantWeight, b: torch.Tensor | None) -> None:
    xq = quant_act.quantize_activations(x, quant_act.block_for(qw.group)).double()
    k = qw.q.shape[1]
    scales = qw.scales.double().repeat_interleave(qw.group, dim=1)
    terms = (qw.q.double() * scales).abs()
    if qw.mins is not None:
        terms = terms + qw.mins.double().abs().repeat_interleave(qw.group, dim=1)
    bias = None if b is None else b.double()
    want = torch.nn.functional.linear(xq, qw.dequantize().double(), bias)
    magnitude = torch.nn.functional.linear(xq.abs(), terms, None if b is None else bias.abs())
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= magnitude * (k + 4) * 2**-24 + 1e-30).all()


@needs_int8
@settings(max_examples=80, deadline=None)
@given(kg=st.sampled_from([("int8", 16), ("int8", 32), ("int8", 64), ("int8", 0), ("int4", 32), ("int4", 128)]),
       m=st.integers(1, 16), blocks=st.integers(1, 5), kb=st.integers(1, 5), bias=st.booleans(), half=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_int8_rows_match_their_definition(kg, m, blocks, kb, bias, half, threads, seed):
    """1-16 rows, int8 and int4 in every group size the formats take (0: one scale per output channel), fp16 and
    fp32 scales, with and without a bias, one or two threads."""
    kind, group = kg
    k = max(group, 32) * kb
    qw = _weight(kind, 16 * blocks, k, group or k, half, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 16, generator=g).repeat_interleave(16, dim=1) * 4
    b = torch.randn(16 * blocks, generator=g) if bias else None
    torch.set_num_threads(threads)
    try:
        got = quant_linear.linear_int8(x, quant.pack(qw), b)
    finally:
        torch.set_num_threads(1)
    _check(got, x, qw, b)


@needs_int8
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_ties_round_to_even_and_zero_blocks_stay_zero(kind):
    """A block whose largest |x| is 127 has d = 1, so x = n + 0.5 is a tie: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0,
    -1.5 -> -2 (nearest even, as torch.round); a second block of zeros has d = 0 and adds nothing. Rounding away
    from zero would move the result by a weight's worth, far outside _check's bound."""
    row = torch.zeros(64)
    row[:6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5])
    x = row[None]
    qx = quant_act.quantize_activations(x, 32)
    assert qx[0, :6].tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -2.0] and not qx[0, 32:].any()
    qw = _weight(kind, 16, 64, 32, True, 3)
    got = quant_linear.linear_int8(x, quant.pack(qw), None)
    _check(got, x, qw, None)
    away = x.clone()
    away[0, 1:6] = torch.tensor([1.0, 2.0, 3.0, -1.0, -2.0])  # what rounding half away from zero would compute
    wrong = torch.nn.functional.linear(away.double(), qw.dequantize().double())
    assert (got.double() - wrong).abs().max() > 1e-3


@needs_int8
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_marked_weights_take_int8_rows_up_to_their_limit(kind):
    """quant_linear.linear on a weight marked int8_activations: up to MAX_ROWS[kind] rows on the int8 kernel (its result,
    not the exact one), above that the exact kernel bit for bit; unmarked weights never take it."""
    qw = _weight(kind, 32, 128, 32, True, 7)
    marked, plain = quant.pack(qw), quant.pack(qw)
    marked.int8_activations = True
    limit = quant_act.MAX_ROWS[kind]
    for rows in (1, limit, limit + 1, 40):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        got, exact = quant_linear.linear(x, marked, None), quant_linear.linear(x, plain, None)
        if rows <= limit:
            assert torch.equal(got, quant_linear.linear_int8(x, marked, None)) and not torch.equal(got, exact)
        else:
            assert torch.equal(got, exact)
    bf = torch.randn(1, 128, dtype=torch.bfloat16)
    assert quant_linear.linear(bf, marked, None).dtype == torch.bfloat16  # cast back to the activations' dtype


def test_the_setting_resolves_as_documented(monkeypatch):
    """none: never; int8: wherever the kernel runs, an error where it does not; auto: a GGUF file's weights on the
    fp32 quantized kernel only."""
    monkeypatch.setattr(quant_act, "ready", lambda: True)
    assert not quant_act.resolve("none", True, "fp32", CPU)
    assert quant_act.resolve("int8", False, "tiles", CPU)
    assert quant_act.resolve("auto", True, "fp32", CPU)
    assert not quant_act.resolve("auto", False, "fp32", CPU)  # --quantization of a float checkpoint
    assert not quant_act.resolve("auto", True, "tiles", CPU)  # the bf16 kernels stay
    assert not quant_act.resolve("auto", True, "avx512-bf16", CPU)
    assert not quant_act.resolve("auto", True, "fp32", torch.device("cuda"))
    with pytest.raises(ValueError, match="quantized_activations int8 needs the native kernels"):
        quant_act.resolve("int8", True, "fp32", torch.device("cuda"))
    monkeypatch.setattr(quant_act, "ready", lambda: False)
    assert not quant_act.resolve("auto", True, "fp32", CPU)
    with pytest.raises(ValueError, match="x86-64 CPU with avx2, fma, f16c"):
        quant_act.resolve("int8", True, "fp32", CPU)
    with pytest.raises(ValueError, match="quantized_activations must be one of auto, none, int8"):
        quant_act.resolve("int4", True, "fp32", CPU)
    with pytest.raises(ValueError, match="quantized_activations"):
        EngineConfig(quantized_activations="fp8")


def _decode_logits(path: str, activations: str, caplog) -> tuple[torch.Tensor, str, list[bool]]:
    """The logits of one decode row after an 8-token prefill, in float32; the start-up line; the weights' marks."""
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.gguf_loader"):
        runner = ModelRunner(path, num_slots=64, dtype="float32", num_threads=1, quantized_activations=activations)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF: kept")][-1]
    ids = [5, 17, 99, 3, 250, 41, 7, 300]
    seq = SeqInput(input_ids=ids, prefix_len=0, row=0, new_slots=list(range(len(ids))), slot_offset=0,
                   sample=False, new_row=True)
    runner.forward_logits([seq])
    step = SeqInput(input_ids=[12], prefix_len=len(ids), row=0, new_slots=[len(ids)], slot_offset=len(ids),
                    sample=False, new_row=False)
    marked = [w.int8_activations for w in runner.model.quantized_weights()]
    return runner.forward_logits([step])[0], line, marked


@needs_int8
def test_a_gguf_model_decodes_on_int8_activations_in_float32(tmp_path, caplog):
    """--dtype float32 on a Q4_0 file: auto marks every kept weight and says so at start-up; the decode row's logits
    move from the exact kernel's by about what int8 activations cost (nonzero, a few percent of their range)."""
    path = export_gguf(cached_checkpoint("llama", **TINY), str(tmp_path / "q4_0.gguf"), "Q4_0")
    exact, exact_line, exact_marks = _decode_logits(path, "none", caplog)
    got, line, marks = _decode_logits(path, "auto", caplog)
    assert exact_line.endswith("; quantized kernel fp32") and not any(exact_marks)
    assert line.endswith("; quantized kernel fp32, int8 activations at decode (--quantized-activations)"), line
    assert marks and all(marks)
    err, scale = (got - exact).abs().max().item(), exact.abs().max().item()
    assert 0 < err < 0.05 * scale, (err, scale)
    assert int(got.argmax()) == int(exact.argmax())
