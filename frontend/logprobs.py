"""Logprob payloads in the three wire formats: OpenAI chat, OpenAI completions, SGLang native."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..kernels.forward_io import TokenLogprob
from ..scheduler.detokenizer import IncrementalDetokenizer


class TokenTexts:
    """Per-token text and bytes, cached (the vocabulary is small and tokens repeat)."""

    def __init__(self, decode_one: Callable[[int], str], token_bytes: Callable[[int], bytes] | None = None,
                 decode_many: Callable[[list[int]], str] | None = None) -> None:
        self._decode_one = decode_one
        self._token_bytes = token_bytes
        self._decode_many = decode_many
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._decode_one(token_id)
        return text

    def joined(self, token_ids: list[int]) -> str:
        """The text of several tokens decoded together (a character split over byte tokens is whole)."""
        if self._decode_many is None:
            return "".join(self.text(t) for t in token_ids)
        return self._decode_many(token_ids)

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            data = self._token_bytes(token_id) if self._token_bytes is not None else None
            if data is None:
                data = self.text(token_id).encode("utf-8")
            raw = self._bytes[token_id] = list(data)
        return raw


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """`choice.logprobs` of a chat completion: {"content": [...]}."""
    return {"content": [_chat_entry(lp.token_id, lp.logprob, texts, lp.top) for lp in entries]}


def _chat_entry(token_id: int, logprob: float, texts: TokenTexts,
                top: list[tuple[int, float]] | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": texts.text(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}
    if top is not None:
        entry["top_logprobs"] = [{"token": texts.text(t), "logprob": lp, "bytes": texts.bytes(t)} for t, lp in top]
    return entry


class CompletionLogprobs:
    """`choice.logprobs` of a completion, built incrementally (text_offset keeps counting).

    Each token's string is the text it adds, as the engine's IncrementalDetokenizer emits it, so
    the strings join to the choice's text: a character split over byte tokens is "" on the tokens
    before the one that completes it, which carries the whole character (held across build calls
    while streaming)."""

    def __init__(self, texts: TokenTexts, text_offset: int = 0) -> None:
        self.texts = texts
        self.offset = text_offset
        self._detok = IncrementalDetokenizer(_JoinedTexts(texts), skip_special_tokens=False)

    def _added_text(self, token_id: int, final: bool) -> str:
        text = self._detok.add(token_id)
        return text + self._detok.finish() if final else text

    def build(self, token_ids: list[int], entries: list[TokenLogprob | None], final: bool = True) -> dict[str, Any]:
        """final: the last call for this choice (a character still split is emitted as is)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for idx, (token_id, lp) in enumerate(zip(token_ids, entries)):
            text = self._added_text(token_id, final and idx == len(token_ids) - 1)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if lp is None:  # the first prompt token has no logprob
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token_logprobs.append(lp.logprob)
                top_logprobs.append(_top_dict(lp.top, self.texts))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


class _JoinedTexts:
    """TokenTexts as the decoder IncrementalDetokenizer takes (special tokens are always shown)."""

    def __init__(self, texts: TokenTexts) -> None:
        self._texts = texts

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **kwargs: bool) -> str:
        return self._texts.joined(list(ids))


def _top_dict(top: list[tuple[int, float]], texts: TokenTexts) -> dict[str, float]:
    out: dict[str, float] = {}
    for token_id, lp in top:
        out.setdefault(texts.text(token_id), lp)  # distinct ids may share a text; keep the best
    return out


def prompt_entries(prompt_ids: list[int], start: int, prompt_logprobs: list[TokenLogprob] | None
                   ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Prompt tokens from `start` with their logprobs; position 0 has none (None)."""
    got = list(prompt_logprobs or [])
    ids = prompt_ids[start:]
    entries: list[TokenLogprob | None] = [None] if start == 0 else []
    entries += got[: len(ids) - len(entries)]
    entries += [None] * (len(ids) - len(entries))  # defensive: never misalign ids and values
    return ids, entries


def native_logprobs(ids: list[int], entries: list[TokenLogprob | None], texts: TokenTexts | None,
                    top_num: int) -> tuple[list[list[Any]], list[Any]]:
    """SGLang lists: [[logprob, token_id, text_or_None]] and the per-position top lists."""
    values: list[list[Any]] = []
    tops: list[Any] = []
    for token_id, lp in zip(ids, entries):
        values.append([lp.logprob if lp is not None else None, token_id, _maybe_text(texts, token_id)])
        if lp is None:
            tops.append(None)
        else:
            tops.append([[v, t, _maybe_text(texts, t)] for t, v in lp.top[:top_num]])
    return values, tops


def _maybe_text(texts: TokenTexts | None, token_id: int) -> str | None:
    return texts.text(token_id) if texts is not None else None


def token_bytes_fn(tokenizer: Any) -> Callable[[int], bytes | None] | None:
    """Exact bytes of a token (a token may hold part of a character): byte-level BPE pieces map back
    through GPT-2's byte alphabet, SentencePiece byte-fallback pieces are <0xNN>; otherwise None."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    try:
        byte_level = "\u0120" in "".join(convert(tokenizer.encode(" a b", add_special_tokens=False)))
    except Exception:  # an unusual tokenizer: fall back to the decoded text's bytes
        return None
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}

    def token_bytes(token_id: int) -> bytes | None:
        piece = convert([token_id])[0]
        if not isinstance(piece, str) or not piece:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        if byte_level and all(ch in byte_of for ch in piece):
            return bytes(byte_of[ch] for ch in piece)
        return None

    return token_bytes


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> printable-character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
