"""The demo tokenizer (byte-level BPE + ChatML template) and the Tokenizer wrapper, checked against transformers."""
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.kernels.demo import build_tokenizer, special_token_ids, write_generation_config
from radixserve.kernels.demo_tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, TOOL_TOKENS
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
