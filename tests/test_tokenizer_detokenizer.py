"""IncrementalDetokenizer: deltas concatenate to tokenizer.decode(ids), never split a character, decode small windows."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.bench.demo_kit.tokenizer import build_tokenizer, special_token_ids
from radixserve.scheduler.detokenizer import IncrementalDetokenizer
from radixserve.scheduler.tokenizer import Tokenizer

VOCAB = 2048


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(path, VOCAB)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def byte_ids(tok):
    """Token id of each single byte (the byte-level alphabet)."""
    table = {}
    for tid in range(VOCAB):
        raw = tok.hf.convert_ids_to_tokens(tid)
        if len(raw) == 1:
            table[_BYTE_OF_CHAR[raw]] = tid
    assert len(table) == 256
    return table


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte <-> printable character table (the byte-level alphabet).
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_decoder()
_SPECIAL = sorted(special_token_ids(VOCAB).values())


def _stream(detok, ids):
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


# Ids drawn from the whole vocabulary, with extra weight on single bytes (which split characters) and on the
# special / tool tokens at the end of the vocabulary.
_any_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(128, 255), st.sampled_from(_SPECIAL))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(_any_id, max_size=40), skip=st.booleans())
def test_deltas_concatenate_to_decode(tok, ids, skip):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_ids == ids


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), skip=st.booleans())
def test_valid_text_split_into_single_bytes_is_never_torn(tok, byte_ids, text, skip):
    """Every character split across as many tokens as it has bytes: no delta ever holds half a character."""
    ids = [byte_ids[b] for b in text.encode("utf-8")]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas if "\ufffd" not in text)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_canonical_encoding_streams_back_to_text(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) == text


def test_emoji_is_held_until_complete(tok, byte_ids):
    ids = [byte_ids[b] for b in "a🚀".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == ["a", "", "", "", "🚀"]
    assert detok.finish() == ""


def test_incomplete_tail_is_flushed_by_finish(tok, byte_ids):
    detok = IncrementalDetokenizer(tok)
    assert detok.add(byte_ids[ord("x")]) == "x"
    assert detok.add(byte_ids[0xE4]) == ""
    assert detok.finish() == "\ufffd" == tok.decode([byte_ids[0xE4]])


def test_add_many_matches_add(tok):
    ids = tok.encode("héllo 世界 🚀 and more text")
    one = IncrementalDetokenizer(tok)
    many = IncrementalDetokenizer(tok)
    assert "".join(one.add(i) for i in ids) + one.finish() == many.add_many(ids[:5]) + many.add_many(ids[5:]) + many.finish()


def test_prompt_context_is_not_emitted(tok):
    prompt = tok.encode("The weather in")
    out = tok.encode(" Paris is 世界🚀 sunny")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(_stream(detok, out)) == tok.decode(out)
    assert detok.output_ids == out


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.max_window = 0
        self.num_calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_window = max(self.max_window, len(ids))
        self.num_calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_only_a_small_window(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 世界 🚀 héllo. " * 60)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    text = "".join(_stream(detok, ids))
    assert text == tok.decode(ids)
    assert len(ids) > 600
    assert counting.max_window <= 8
    assert counting.num_calls <= 2 * (len(ids) + 1)
