"""The demo tokenizer (byte-level BPE + ChatML template) and the Tokenizer wrapper, checked against transformers."""
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.bench.demo_kit.tokenizer import build_tokenizer, special_token_ids, write_generation_config
from radixserve.bench.demo_kit.tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, TOOL_TOKENS
from radixserve.scheduler.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "Sunny, 21 °C.", "tool_calls": [{"name": "log", "arguments": {"ok": True}}]},
    {"role": "user", "content": "Thanks! 世界 🚀"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(path, 2048)
    write_generation_config(path, 2048)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    return AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 2048, 4096, 5000])
def test_vocab_has_exactly_vocab_size_ids(tmp_path, vocab_size):
    build_tokenizer(str(tmp_path), vocab_size)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(hf) == vocab_size
    ids = special_token_ids(vocab_size)
    for name in SPECIAL_TOKENS + TOOL_TOKENS:
        assert hf.convert_ids_to_tokens(ids[name]) == name
    assert sorted(ids.values()) == list(range(min(ids.values()), min(ids.values()) + 7))
    assert max(hf.get_vocab().values()) == vocab_size - 1


def test_too_small_vocab_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="at least"):
        build_tokenizer(str(tmp_path), MIN_VOCAB_SIZE - 1)


def test_build_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_tokenizer(str(a), 1024)
    build_tokenizer(str(b), 1024)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "tokenizer.json").read_bytes() != _build_bytes(tmp_path / "c", 2048)


def _build_bytes(path, vocab_size):
    build_tokenizer(str(path), vocab_size)
    return (path / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    "text",
    ["Hello, world!", "  two  spaces\tand\ttabs\n\nlines ", "héllo 世界 🚀", "<|im_start|>user\nhi<|im_end|>",
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "", "x = [1, 2, 3]  # code", "🚀🚀 ÿ \x00\x7f"],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids == tok.encode(text, add_special_tokens=False)  # no BOS, like Qwen


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_skipped_but_tool_tags_kept(tok):
    ids = tok.encode("<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>")
    assert tok.decode(ids) == "assistant\n<tool_call>{}</tool_call>"
    ids_of = special_token_ids(2048)
    assert ids.count(ids_of["<tool_call>"]) == 1 and ids.count(ids_of["<|im_end|>"]) == 1


def test_multibyte_characters_are_split_across_tokens(tok):
    ids = tok.encode("🚀")
    assert len(ids) > 1
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert tok.decode(ids) == "🚀"


def test_wrapper_metadata(tok, tok_dir, hf):
    ids = special_token_ids(2048)
    assert tok.eos_token_ids == sorted([ids["<|im_end|>"], ids["<|endoftext|>"]])
    with open(os.path.join(tok_dir, "generation_config.json")) as f:
        assert sorted(json.load(f)["eos_token_id"]) == tok.eos_token_ids
    assert tok.vocab_size == len(hf) == 2048
    assert tok.bos_token_id is None
    assert tok.convert_ids_to_tokens(tok.encode("hello world")) == hf.convert_ids_to_tokens(hf.encode("hello world"))
    assert ids["<|im_end|>"] in tok.special_token_ids and ids["<tool_call>"] not in tok.special_token_ids


def test_eos_from_generation_config_int(tmp_path):
    build_tokenizer(str(tmp_path), 512)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer(str(tmp_path)).eos_token_ids == sorted({7, special_token_ids(512)["<|im_end|>"]})


def test_chat_template_equals_transformers(tok, hf):
    for tools in (None, TOOLS):
        for gen in (True, False):
            expected = hf.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=gen, tokenize=True)
            assert tok.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=gen) == expected["input_ids"]
            text = hf.apply_chat_template(CONVERSATION, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert tok.render_chat(CONVERSATION, tools=tools, add_generation_prompt=gen) == text


def test_chat_template_content(tok):
    text = tok.render_chat(CONVERSATION, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>' in text
    assert 'Sunny, 21 °C.\n<tool_call>{"name": "log", "arguments": {"ok": true}}</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temperature\": 21}\n</tool_response><|im_end|>\n" in text
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks! 世界 🚀<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_rendering_is_prefix_stable(tok):
    """Extending a conversation never rewrites its past (the DSL reuses the shorter rendering as a prefix)."""
    for tools in (None, TOOLS):
        previous = ""
        for k in range(1, len(CONVERSATION) + 1):
            text = tok.render_chat(CONVERSATION[:k], tools=tools, add_generation_prompt=False)
            assert text.startswith(previous) and len(text) > len(previous)
            assert tok.render_chat(CONVERSATION[:k], tools=tools).startswith(text)
            previous = text


def test_missing_files_and_template_are_clear_errors(tmp_path, tok_dir):
    with pytest.raises(ValueError, match="no tokenizer files"):
        Tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        Tokenizer(str(tmp_path / "missing"))
    no_template = tmp_path / "plain"
    build_tokenizer(str(no_template), 512)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    plain = Tokenizer(str(no_template))
    assert plain.encode("hi") and not plain.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "hi"}])


# --- parity with transformers' AutoTokenizer on every kind of checkpoint the repo builds -----------------------------

from hypothesis import HealthCheck  # noqa: E402

import _tokenizer_variants as variants  # noqa: E402
from _http_server import scripted_model_path as http_scripted_model_path  # noqa: E402
from _http_server import tiny_model_path  # noqa: E402
from radixserve.bench.checkpoints import ARCHITECTURES, cached_checkpoint, scripted_model_path  # noqa: E402
from radixserve.kernels.demo import demo_model_path  # noqa: E402

# One tiny checkpoint per architecture, with vocabularies from the smallest the tokenizer allows to one with
# reserved special tokens (the corpus fills ~4150 ids with merges).
ARCH_VOCABS = {"llama": 4200, "qwen2": 5000, "qwen3": MIN_VOCAB_SIZE, "mistral": 1024}
ARCH_SIZES = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                  max_position_embeddings=256)
VARIANTS = {"bos_dicts": variants.build_bos_dicts, "legacy_map": variants.build_legacy_map,
            "declared": variants.build_declared, "wordpiece": variants.build_wordpiece}
SAVED = {"saved_declared": "declared", "saved_bos_dicts": "bos_dicts"}  # re-saved by transformers 5
KINDS = ("demo", "scripted", "tiny", "http_scripted", *ARCHITECTURES, *VARIANTS, *SAVED)

MULTI_TURN = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? <|im_start|>assistant\n<s> [INST] <tool_call> [CLS]"},
    {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy's capital is Rome."},
    {"role": "user", "content": "  spaced\tout\n\n  "},
]
CHATS = {"tools_and_parts": CONVERSATION, "multi_turn": MULTI_TURN, "one_user": [{"role": "user", "content": "hi"}]}


def _checkpoint(kind: str, root) -> str:
    if kind == "demo":
        return demo_model_path()
    if kind == "scripted":
        return scripted_model_path()
    if kind == "tiny":
        return tiny_model_path()
    if kind == "http_scripted":
        return http_scripted_model_path()
    if kind in ARCH_VOCABS:
        return cached_checkpoint(kind, vocab_size=ARCH_VOCABS[kind], **ARCH_SIZES)
    out = root / kind
    if not out.exists():
        if kind in VARIANTS:
            VARIANTS[kind](str(out))
        else:
            variants.save_with_transformers(_checkpoint(SAVED[kind], root), str(out))
    return str(out)


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """(ours, transformers') tokenizers of one checkpoint kind."""
    path = _checkpoint(request.param, tmp_path_factory.getbasetemp() / "tokenizer-kinds")
    return Tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_kinds_cover_the_architectures_and_saved_templates(tmp_path_factory):
    assert set(ARCH_VOCABS) == set(ARCHITECTURES)
    saved = _checkpoint("saved_declared", tmp_path_factory.getbasetemp() / "tokenizer-kinds")
    assert os.path.isfile(os.path.join(saved, "chat_template.jinja"))  # what transformers 5 writes
    assert os.listdir(os.path.join(saved, "additional_chat_templates")) == ["tool_use.jinja"]


def test_metadata_parity(pair):
    ours, hf = pair
    assert ours.vocab_size == len(hf)
    assert ours.bos_token_id == hf.bos_token_id and ours.pad_token_id == hf.pad_token_id
    assert ours.special_token_ids == {i for i in hf.all_special_ids if i is not None}
    if hf.eos_token_id is not None:
        assert hf.eos_token_id in ours.eos_token_ids
    assert ours.chat_template == hf.chat_template and ours.has_chat_template == bool(hf.chat_template)


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_chat_template_parity(pair, chat):
    ours, hf = pair
    messages = CHATS[chat]
    for tools in (None, TOOLS):
        for gen in (True, False):
            text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)
            assert ours.render_chat(messages, tools=tools, add_generation_prompt=gen) == text
            ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True)["input_ids"]
            assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen) == ids


def test_template_kwargs_and_named_templates(pair):
    ours, hf = pair
    kwargs = {"date_string": "26 Jul 2024", "enable_thinking": False}
    expected = hf.apply_chat_template(MULTI_TURN, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render_chat(MULTI_TURN, **kwargs) == expected
    if isinstance(hf.chat_template, dict):
        for name in hf.chat_template:
            expected = hf.apply_chat_template(MULTI_TURN, chat_template=name, tokenize=False)
            assert ours.render_chat(MULTI_TURN, add_generation_prompt=False, chat_template=name) == expected


def _texts(hf):
    added = sorted(hf.get_added_vocab())
    pieces = st.one_of(st.text(max_size=12), st.sampled_from(added),
                       st.sampled_from([" ", "\n", "\t", "  ", " 's", " .", " n't", "<|im_", "é", "🚀", "\ufffd"]))
    return st.lists(pieces, max_size=8).map("".join)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_encode_decode_parity(pair, data):
    ours, hf = pair
    text = data.draw(_texts(hf), label="text")
    for add in (True, False):
        ids = hf.encode(text, add_special_tokens=add)
        assert ours.encode(text, add_special_tokens=add) == ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    special = sorted(ours.special_token_ids | set(hf.get_added_vocab().values()))
    any_ids = data.draw(st.lists(st.one_of(st.integers(0, len(hf) - 1), st.sampled_from(special)), max_size=16),
                        label="ids")
    for skip in (True, False):
        assert ours.decode(any_ids, skip_special_tokens=skip) == hf.decode(any_ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(any_ids) == hf.convert_ids_to_tokens(any_ids)


def _vocab_merges_only(out, tokenizer_class: str, keep_json: bool) -> str:
    """The demo tokenizer as GPT-2 style vocab.json + merges.txt (with or without tokenizer.json)."""
    from tokenizers import Tokenizer as RustTokenizer

    build_tokenizer(str(out), 512)
    RustTokenizer.from_file(str(out / "tokenizer.json")).model.save(str(out))
    if not keep_json:
        os.remove(out / "tokenizer.json")
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("keep_json", [False, True], ids=["no_tokenizer_json", "model_specific_class"])
def test_falls_back_to_transformers_for_other_pipelines(tmp_path, caplog, keep_json):
    path = _vocab_merges_only(tmp_path, "GPT2Tokenizer", keep_json)
    with caplog.at_level("INFO", logger="radixserve.scheduler.tokenizer"):
        ours = Tokenizer(path)
    assert "AutoTokenizer" in caplog.text
    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    text = "Hello <|im_start|> wörld 🚀 <tool_call>"
    ids = hf.encode(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    expected = hf.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert ours.apply_chat_template(CONVERSATION, tools=TOOLS) == expected["input_ids"]
    assert ours.vocab_size == len(hf) and ours.hf is not None


def test_encode_decode_from_many_threads(tok):
    """The Rust tokenizer is shared without a lock: concurrent calls give the single-threaded answers."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"thread {i}: héllo 世界 🚀 <|im_start|>{'x' * i}" for i in range(64)]
    expected = [tok.encode(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(tok.encode, texts * 4))
        decoded = list(pool.map(lambda x: tok.decode(x, skip_special_tokens=False), ids))
    assert ids == expected * 4 and decoded == texts * 4


def test_template_options_that_are_not_variables_are_refused(tok):
    with pytest.raises(TypeError, match="tokenize"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(ValueError, match="empty"):
        tok.render_chat([])
