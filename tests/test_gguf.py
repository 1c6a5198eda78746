"""GGUF files as a model (kernels/gguf_file.py, gguf_loader.py, scheduler/gguf_tokenizer.py).

- Round trip: tiny checkpoints written as GGUF by bench/checkpoints/gguf_export.py (F32, F16, Q8_0, Q4_0; Llama's q/k
  rows permuted as llama.cpp does, tied embeddings, Llama 3.1 rope as a rope_freqs tensor) load to exactly the
  weights of the float checkpoint their dequantized values make, and greedy output through the Engine is the same.
- The tokenizer transformers builds from the GGUF encodes, decodes and renders chat like the original.
- tests/fixtures/tiny-llama-q4_k_m.gguf, made once by llama.cpp's llama-quantize (tests/fixtures/make_gguf_q4_k_m.py):
  its Q4_K / Q6_K / Q5_0 / Q8_0 tensors dequantize in row blocks exactly as the gguf package does, stay close to
  the seeded weights llama.cpp's converter started from, and the Engine serves it.
- Block tensors map onto quant.QuantWeight (int8 / affine int4 with per-group scales) without loss.
- Bad files: not GGUF, truncated, an unknown or unsupported tensor type, another architecture: one line each, and
  exit 2 from the CLI before the engine starts.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from _http_server import SCRIPTS, ServerProcess, scripted_model_path
from radixserve.bench.checkpoints import gguf_export
from radixserve.bench.checkpoints.gguf_export import dequantized_copy, export_gguf
from radixserve.bench.checkpoints.random_weights import build_checkpoint, cached_checkpoint
from radixserve.kernels import ModelRunner, SeqInput, gguf_loader, native, quant, quant_linear
from radixserve.kernels import runner as runner_module
from radixserve.kernels.gguf_file import hf_tensor_name
from radixserve.kernels.gguf_quant import LOSSLESS, TWO_LEVEL, packed_weight, quant_weight
from radixserve.kernels.loader import load_state_dict
from radixserve.kernels.model_config import load_model_config
from radixserve.kernels.quant import PackedQuant, QuantWeight, pack
from radixserve.scheduler import Engine, SamplingParams
from radixserve.scheduler.tokenizer import Tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "tiny-llama-q4_k_m.gguf")
TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            initializer_range=0.1)
LLAMA3_ROPE = dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
PROMPTS = ["Hello there, how are", [5, 6, 7, 8, 9, 10, 11, 12]]
CPU = torch.device("cpu")


def greedy(path: str, dtype: str = "float32") -> list[list[int]]:
    """Greedy outputs with activations in `dtype` (the weights' loading is what these tests compare)."""
    engine = Engine(path, dtype=dtype, num_threads=1, kv_cache_tokens=1024, quantized_activations="none")
    try:
        return [r.output_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0))]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch, qtype, extra", [
    ("llama", "F32", {}), ("llama", "Q8_0", {}), ("llama", "Q4_0", {}), ("qwen2", "Q8_0", {}),
    ("qwen3", "Q4_0", {}), ("mistral", "F16", {}), ("llama", "Q8_0", {"tie_word_embeddings": True}),
    ("llama", "F32", LLAMA3_ROPE),
])
def test_round_trip_loads_the_dequantized_model(tmp_path, arch, qtype, extra):
    src = cached_checkpoint(arch, **TINY, **extra)
    path = export_gguf(src, str(tmp_path / f"{arch}-{qtype}.gguf"), qtype)
    ref = dequantized_copy(src, str(tmp_path / "ref"), qtype)
    ours = gguf_loader.load_gguf_state_dict(path, torch.float32, CPU)
    want = load_state_dict(ref, torch.float32, CPU)
    assert sorted(ours) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name
    if qtype in ("Q8_0", "Q4_0"):  # the file really is quantized: its weights are not the original's
        original = load_state_dict(src, torch.float32, CPU)["model.layers.0.mlp.up_proj.weight"]
        assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], original)
    assert greedy(path) == greedy(ref)


def test_tokenizer_from_the_gguf_round_trips_like_the_original(tmp_path):
    # the Qwen2Tokenizer pipeline (its own split: digits one by one), with enough merges for the splits to matter
    src = cached_checkpoint("qwen2", vocab_size=5000, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_position_embeddings=256)
    path = export_gguf(src, str(tmp_path / "qwen2.gguf"), "F32")
    ours, original = Tokenizer(path), Tokenizer(src)
    texts = ["Hello world, héllo 123 ünïcode\n\n  x", "  spaces\tand 😀 emoji 12345 in 2024 ", "don't DON'T it's",
             "<|im_start|>user\nhi<|im_end|><tool_call>{}</tool_call>"]
    for text in texts:
        ids = original.encode(text, add_special_tokens=True)
        assert ours.encode(text, add_special_tokens=True) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == original.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert ours.render_chat(messages) == original.render_chat(messages)
    assert ours.eos_token_ids == original.eos_token_ids and ours.vocab_size == original.vocab_size
    cache = tmp_path / "cache"  # a fresh cache: the tokenizer is built in a child process, torch never imported
    code = ("import sys; from radixserve.scheduler.tokenizer import Tokenizer; "
            f"t = Tokenizer({path!r}); print(t.encode('Hello world', add_special_tokens=True), "
            "'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RADIXSERVE_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [*str(original.encode("Hello world")).split(), "False", "False"]


def test_q4_k_m_fixture_dequantizes_as_the_gguf_package_does(monkeypatch):
    monkeypatch.setattr(gguf_loader, "BLOCK_ELEMENTS", 3000)  # several row blocks per tensor
    reader = GGUFReader(FIXTURE)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= {t.tensor_type.name for t in reader.tensors}
    report = gguf_loader.DequantReport(torch.float32)
    for t in reader.tensors:
        ours = gguf_loader.tensor_weight(t.data, t.tensor_type, torch.float32, report)
        theirs = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert torch.equal(ours, torch.from_numpy(theirs).reshape(ours.shape)), t.name
    assert report.tensors["Q4_K"] > 0 and report.max_rel_error == 0.0  # float32: no rounding at all


def test_q4_k_m_fixture_is_near_its_seeded_weights_and_serves(tmp_path, caplog):
    # the seeded checkpoint llama.cpp's converter started from (make_gguf_q4_k_m.py's arguments)
    src = build_checkpoint(str(tmp_path / "src"), "llama", seed=7, vocab_size=512, hidden_size=256, num_layers=2,
                           num_heads=4, num_kv_heads=2, intermediate_size=128, initializer_range=0.1,
                           max_position_embeddings=512)
    original = load_state_dict(src, torch.float32, CPU)
    state = dict(gguf_loader.load_gguf_state_dict(FIXTURE, torch.float32, CPU))
    assert sorted(state) == sorted(original)
    for name, tensor in state.items():  # names, shapes and q / k row order all as the HF checkpoint's
        err = ((tensor - original[name]).norm() / original[name].norm()).item()
        assert err < 0.12, (name, err)
    ref = tmp_path / "ref"
    shutil.copytree(src, ref)
    os.remove(ref / "model.safetensors")
    save_file(dict(state), str(ref / "model.safetensors"))
    assert greedy(FIXTURE) == greedy(str(ref))
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.gguf_loader"):
        state = gguf_loader.load_gguf_state_dict(FIXTURE, torch.bfloat16, CPU)
        for name in list(state):  # taking the last tensor logs the report
            state.pop(name)
    line = next(r.getMessage() for r in caplog.records if "dequantized" in r.getMessage())
    assert all(kind in line for kind in ("Q4_K", "Q6_K", "Q5_0", "Q8_0")) and "to bfloat16" in line
    assert 0 < float(re.search(r"max relative error .* ([0-9.e+-]+) over", line).group(1)) <= 2 ** -8


def _patched(tmp_path, name: str, edit) -> str:
    with open(FIXTURE, "rb") as f:
        data = bytearray(f.read())
    edit(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return str(path)


def _set_first_type(type_id: int):
    def edit(data: bytearray) -> None:
        t = GGUFReader(FIXTURE).tensors[0]  # type: after the name (u64 length + bytes), n_dims and the dims
        at = t.field.offset + 8 + len(t.name) + 4 + 8 * len(t.shape)
        assert int.from_bytes(data[at:at + 4], "little") == t.tensor_type.value
        data[at:at + 4] = type_id.to_bytes(4, "little")
    return edit


def _set_architecture(data: bytearray) -> None:
    key = b"general.architecture" + (8).to_bytes(4, "little") + (5).to_bytes(8, "little")
    at = data.index(key + b"llama") + len(key)
    data[at:at + 5] = b"gemma"


BAD_FILES = [
    ("not-gguf.gguf", lambda d: d.__setitem__(slice(0, 4), b"GGML"), "is not a GGUF file"),
    ("cut-data.gguf", lambda d: d.__delitem__(slice(len(d) // 2, None)), "is truncated: tensor '"),
    ("cut-header.gguf", lambda d: d.__delitem__(slice(3000, None)), "is truncated or corrupt: its metadata runs"),
    ("cut-early.gguf", lambda d: d.__delitem__(slice(40, None)), "is truncated or corrupt: its metadata runs"),
    ("unknown-type.gguf", _set_first_type(99), "'output.weight' has type 99 (unknown), which radixserve does not"),
    ("q2_k.gguf", _set_first_type(10), "type Q2_K, which radixserve does not load; supported: F32"),
    ("gemma.gguf", _set_architecture, "unsupported GGUF architecture 'gemma'; supported: llama (Llama, Mistral)"),
]


@pytest.mark.parametrize("name, edit, message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_gguf_files_fail_in_one_line(tmp_path, name, edit, message):
    path = _patched(tmp_path, name, edit)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_model_config(path)
    assert "\n" not in str(info.value) and path in str(info.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        Engine(path, num_threads=1, kv_cache_tokens=256)


def _yarn_gguf(tmp_path, monkeypatch) -> str:
    import gguf

    write_config = gguf_export._write_config

    def with_yarn(writer, cfg):
        write_config(writer, cfg)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf_export, "_write_config", with_yarn)
    return export_gguf(cached_checkpoint("llama", **TINY), str(tmp_path / "yarn.gguf"), "F32")


@pytest.mark.parametrize("name, message", [("q2_k.gguf", "Q2_K, which radixserve does not load"),
                                           ("missing.gguf", "no such GGUF file"),
                                           ("yarn.gguf", "unsupported rope type 'yarn'; supported: default")])
def test_cli_refuses_a_bad_gguf_before_loading(tmp_path, monkeypatch, name, message):
    path = {"q2_k.gguf": lambda: _patched(tmp_path, name, _set_first_type(10)),
            "missing.gguf": lambda: str(tmp_path / name),
            "yarn.gguf": lambda: _yarn_gguf(tmp_path, monkeypatch)}[name]()
    r = subprocess.run([sys.executable, "-m", "radixserve.frontend.cli", "serve", "--port", "0", "--model", path],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_tensor_names_outside_the_forward_are_refused():
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="'blk.0.ffn_gate_exps.weight' has no counterpart"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_block_tensors_map_onto_quant_weights_without_loss(tmp_path):
    """Q8_0, Q5_0, Q6_K (int8, groups 32 / 32 / 16) and Q4_0, Q4_1, Q4_K (affine int4, group 32) stand for exactly
    the values the gguf package dequantizes, in the compact forms (Q4_K, Q6_K two-level, Q4_0 symmetric) or expanded,
    rows split into blocks and Llama's q / k rows reordered as floats are."""
    reader = GGUFReader(FIXTURE)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32)
    cases = [(t.data, t.tensor_type) for t in reader.tensors if t.tensor_type.name in LOSSLESS]
    cases += [(quantize(w, GGMLQuantizationType[k]), GGMLQuantizationType[k]) for k in ("Q4_0", "Q4_1", "Q5_0")]
    assert {q.name for _, q in cases} == set(LOSSLESS)
    for (data, qtype), compact in itertools.product(cases, (True, False)):
        qw = quant_weight(data, qtype, block_elements=5000, compact=compact)
        assert (qw.kind, qw.group) == LOSSLESS[qtype.name]
        assert qw.two_level == (compact and qtype.name in TWO_LEVEL)  # Q4_K, Q6_K: fp16 factors, int8 sub-scales
        assert qw.symmetric == (compact and qtype.name == "Q4_0")  # its mins -8 d implied
        want = torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32))
        assert torch.equal(qw.dequantize(), want), qtype.name
    floats = gguf_loader.load_gguf_state_dict(FIXTURE, torch.float32, CPU)
    kept = gguf_loader.load_gguf_state_dict(FIXTURE, torch.float32, CPU, keep_quantized=True)
    assert isinstance(kept["model.embed_tokens.weight"], PackedQuant)  # looked up row by row, and a tied head
    assert isinstance(kept["model.layers.0.mlp.down_proj.weight"], PackedQuant)  # packed as read: no fusion
    assert isinstance(kept["model.layers.0.self_attn.q_proj.weight"], QuantWeight)
    for name, tensor in floats.items():
        got = kept[name]
        got = got.unpack() if isinstance(got, PackedQuant) else got
        got = got.dequantize() if isinstance(got, QuantWeight) else got
        assert torch.equal(got, tensor), name


def test_packing_in_row_blocks_as_read_changes_nothing():
    """gguf_quant.packed_weight (embedding, head, o / down: packed a block of rows at a time) equals packing the whole
    QuantWeight, every LOSSLESS type, blocks of 16 rows and the last one short."""
    w = np.random.default_rng(1).standard_normal((80, 256)).astype(np.float32)
    reader = GGUFReader(FIXTURE)
    cases = [(t.data, t.tensor_type) for t in reader.tensors if t.tensor_type.name in LOSSLESS and t.data.ndim == 2
             and t.data.shape[0] % 16 == 0]
    cases += [(quantize(w, GGMLQuantizationType[k]), GGMLQuantizationType[k]) for k in ("Q4_0", "Q4_1", "Q5_0")]
    for (data, qtype), compact in itertools.product(cases, (True, False)):
        whole = pack(quant_weight(data, qtype, compact=compact))
        blocks = packed_weight(data, qtype, block_elements=3000, compact=compact)
        assert all(torch.equal(a, b) for a, b in ((whole.data, blocks.data), (whole.scales, blocks.scales))), qtype
        assert whole.mins is None or torch.equal(whole.mins, blocks.mins)


def test_a_load_transform_sees_float_tensors_in_float32(tmp_path):
    src = cached_checkpoint("llama", **TINY)
    path = export_gguf(src, str(tmp_path / "bf16.gguf"), "BF16")
    seen = []

    def transform(name, t):
        seen.append((name, t.dtype))
        return t * 2 if name.endswith("o_proj.weight") else t

    state = gguf_loader.load_gguf_state_dict(path, torch.bfloat16, CPU, transform)
    plain = gguf_loader.load_gguf_state_dict(path, torch.bfloat16, CPU)
    for name, tensor in plain.items():
        assert torch.equal(state[name], tensor * 2 if name.endswith("o_proj.weight") else tensor), name
    assert {d for _, d in seen} == {torch.float32} and len(seen) == len(plain)


def test_server_serves_a_gguf_file_over_http(tmp_path):
    """`serve --model FILE.gguf`: the HTTP process reads the GGUF's tokenizer and chat template (without torch), the
    engine its weights; the scripted model, written as GGUF, still answers its script through the chat template."""
    path = export_gguf(scripted_model_path(), str(tmp_path / "scripted.gguf"), "F32")
    server = ServerProcess(["--model", path, "--port", "0", "--kv-cache-tokens", "4096"])
    try:
        with server.client() as http:
            models = http.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["scripted.gguf"]
            body = {"messages": [{"role": "user", "content": "Write a poem"}], "max_tokens": 64, "temperature": 0}
            reply = http.post("/v1/chat/completions", json=body).json()
            assert reply["choices"][0]["message"]["content"] == SCRIPTS["poem"], reply
            assert reply["choices"][0]["finish_reason"] == "stop"
        assert "GGUF: no quantized tensors" in server.log()  # the start-up line reaches the server's log
    finally:
        server.stop()


def prefill_logits(path: str, dtype: str, monkeypatch, keep: bool = False) -> torch.Tensor:
    """The logits of a 12-token prefill by a ModelRunner on `path`, its block tensors kept quantized or not (on a
    CPU without the quantized tile kernel, kept weights run through quant_linear.linear's dequantizing path), activations
    in the model's dtype (int8 ones: test_quant_act.py)."""
    monkeypatch.setattr(runner_module, "keeps_blocks", lambda dtype, device: keep)
    runner = ModelRunner(path, num_slots=64, dtype=dtype, num_threads=1, quantized_activations="none")
    ids = [5, 17, 99, 3, 250, 41, 7, 7, 300, 12, 64, 128]
    seq = SeqInput(input_ids=ids, prefix_len=0, row=0, new_slots=list(range(len(ids))), slot_offset=0,
                   sample=False, new_row=True)
    return runner.forward_logits([seq])[0]


def check_kept_quantized(path: str, monkeypatch, caplog, kept_line: str) -> None:
    """Kept quantized in bf16, the model is as close to the exact one (float32, dequantized) as the bf16 model of the
    bf16-rounded dequantized weights is (within 2x: the tile kernel may skip the weights' rounding)."""
    exact = prefill_logits(path, "float32", monkeypatch)
    rounded = prefill_logits(path, "bfloat16", monkeypatch)
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.gguf_loader"):
        kept = prefill_logits(path, "bfloat16", monkeypatch, keep=True)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF: kept"))
    assert kept_line in line, line
    bound = (rounded - exact).abs().max().item()
    assert 0 < bound < 0.1 * exact.abs().max().item()
    assert (kept - exact).abs().max().item() <= 2 * bound, ((kept - exact).abs().max().item(), bound)


def test_q4_k_m_fixture_kept_quantized_is_as_accurate_as_bf16(monkeypatch, caplog):
    """The fixture's block tensors kept as QuantWeights (q / k / v and gate / up fused; layer 1's v is Q6_K beside
    Q4_K q / k: that fusion stays quantized as a QuantStack of an int4 [q; k] and an int8 v, nothing is dequantized;
    the embedding table is kept, its rows looked up)."""
    check_kept_quantized(FIXTURE, monkeypatch, caplog, "kept Q4_K (12 tensors), Q5_0 (1 tensors), Q6_K (2 tensors), "
                         "Q8_0 (1 tensors) quantized, without loss, in ")
    monkeypatch.setattr(runner_module, "keeps_blocks", lambda dtype, device: True)
    model = ModelRunner(FIXTURE, num_slots=64, dtype="float32", num_threads=1, quantized_activations="none").model
    stack = model.layers[1].qkv.quant
    assert isinstance(stack, quant.QuantStack) and [(p.kind, p.group) for p in stack.parts] == [("int4", 32),
                                                                                               ("int8", 16)]
    assert stack.n == model.q_size + 2 * model.kv_size and stack.parts[1].n == model.kv_size
    assert all(p.two_level for p in stack.parts)  # the fp32 kernel reads Q4_K / Q6_K's factors and sub-scales
    assert isinstance(model.layers[0].qkv.quant, quant.PackedQuant)
    assert set(map(id, stack.parts)) <= set(map(id, model.quantized_weights()))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_round_trip_kept_quantized_is_as_accurate_as_bf16(tmp_path, monkeypatch, caplog, qtype):
    path = export_gguf(cached_checkpoint("llama", **TINY), str(tmp_path / f"{qtype}.gguf"), qtype)
    check_kept_quantized(path, monkeypatch, caplog, f"kept {qtype} (16 tensors) quantized")


def test_tied_table_kept_quantized_is_the_head_and_as_accurate_as_bf16(tmp_path, monkeypatch, caplog):
    """A tied Q4_0 table stays packed: the rows the forward looks up and the LM head are one PackedQuant (no second
    copy), as accurate as the bf16 model of the rounded weights."""
    src = cached_checkpoint("llama", **TINY, tie_word_embeddings=True)
    path = export_gguf(src, str(tmp_path / "tied.gguf"), "Q4_0")
    check_kept_quantized(path, monkeypatch, caplog, "kept Q4_0 (15 tensors) quantized")
    model = ModelRunner(path, num_slots=64, dtype="bfloat16", num_threads=1).model
    assert isinstance(model.embed, quant.PackedQuant) and model.lm_head.quant is model.embed


def test_engine_keeps_blocks_where_a_quantized_kernel_runs():
    assert gguf_loader.keeps_blocks(torch.bfloat16, CPU) == (quant_linear.kernel() is not None)
    assert gguf_loader.keeps_blocks(torch.float32, CPU) == (quant_linear.kernel(torch.float32) == "fp32")
    assert not gguf_loader.keeps_blocks(torch.float16, CPU)


@pytest.mark.skipif(native.cannot_build() is not None, reason=native.cannot_build() or "")
@pytest.mark.parametrize("path", [FIXTURE, "Q4_0"])
def test_kept_quantized_in_float32_is_the_float32_model(path, tmp_path, monkeypatch, caplog):
    """In fp32 the kept blocks run on the fp32 kernel (every build: AVX2-only CPUs keep a GGUF's blocks too): the
    logits are the fp32 model's of the dequantized weights, up to the order of fp32 sums, far inside bf16's error."""
    if path == "Q4_0":
        path = export_gguf(cached_checkpoint("llama", **TINY), str(tmp_path / "q4_0.gguf"), "Q4_0")
    exact = prefill_logits(path, "float32", monkeypatch)
    with caplog.at_level(logging.INFO, logger="radixserve.kernels.gguf_loader"):
        kept = prefill_logits(path, "float32", monkeypatch, keep=True)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF: kept"))
    assert line.endswith("; quantized kernel fp32"), line
    # held as the file's bytes in the compact forms: Q4_0 exactly; the fixture's Q5_0 / Q6_K values take 8 bits
    held = float(re.search(r"\(([0-9.]+)x their bytes in the file\)", line).group(1))
    assert held == 1.0 if path.endswith("q4_0.gguf") else 1.05 < held < 1.3, line
    rounded = prefill_logits(path, "bfloat16", monkeypatch)
    err, bf16_err = (kept - exact).abs().max().item(), (rounded - exact).abs().max().item()
    assert err <= 1e-4 * exact.abs().max().item() and err < bf16_err / 50, (err, bf16_err)
    monkeypatch.setattr(runner_module, "keeps_blocks", lambda dtype, device: True)
    model = ModelRunner(path, num_slots=64, dtype="float32", num_threads=1, quantized_activations="none").model
    forms = {(w.two_level, w.symmetric) for w in model.quantized_weights()}  # the compact forms, as read
    assert forms == ({(False, True)} if path.endswith("q4_0.gguf") else {(True, False), (False, False)}), forms


def test_quantization_flag_applies_to_a_float_gguf_as_to_its_checkpoint(tmp_path):
    """--quantization int8 quantizes an F32 GGUF's linears as it does the safetensors checkpoint's: same tokens."""
    src = cached_checkpoint("llama", **TINY)
    path = export_gguf(src, str(tmp_path / "f32.gguf"), "F32")

    def run(model: str) -> list[list[int]]:
        engine = Engine(model, dtype="bfloat16", quantization="int8", num_threads=1, kv_cache_tokens=1024)
        try:
            layer = engine.runner.model.layers[0]
            assert layer.qkv.quant is not None and layer.down.quant is not None
            return [r.output_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0))]
        finally:
            engine.shutdown()

    assert run(path) == run(src)


def test_sentencepiece_gguf_tokenizer_reads_as_transformers_builds_it(tmp_path):
    """A llama.cpp "llama" (sentencepiece) vocabulary, as Llama 2 and Mistral files hold: scores, byte fallback
    tokens, BOS added. Our Tokenizer of the saved directory encodes, decodes and renders as transformers' GGUF one."""
    import gguf
    from transformers import AutoTokenizer

    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for key, value in dict(block_count=1, context_length=128, embedding_length=32, feed_forward_length=64,
                           head_count=2, head_count_kv=1).items():
        getattr(writer, f"add_{key}")(value)
    pieces = ["▁hello", "▁world", "▁he", "llo", "▁w", "orld", "▁", "h", "e", "l", "o", "w", "r", "d", "▁the"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}</s>{% endfor %}")
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), 32), "output_norm.weight": (32,),
              "blk.0.attn_norm.weight": (32,),
              "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
              "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = str(tmp_path / "spm.gguf")
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", "the world hello", "héllo wörld 😀", " hello  world "]:
        ids = theirs(text).input_ids
        assert ids[0] == 1 and ours.encode(text, add_special_tokens=True) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text.removeprefix(" "), text
    assert ours.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi</s>"
    assert len(greedy(path)[0]) == 12  # and it serves (a tied head, the table read as the head)
