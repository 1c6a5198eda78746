"""Incremental detokenization: text deltas for a growing list of token ids, never splitting a character.

Decoding a window of recent tokens instead of the whole sequence (the prefix/read offset technique):

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 \\_ already emitted _/  \\_ not yet emitted _/
    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

Both decodes start at the same token, so whatever a decoder does at a window's start (a sentencepiece tokenizer
drops the leading space of the first token) cancels out. The delta is held back while the window's text ends in
U+FFFD: the last token may end inside a multi-byte character that the next token completes. Once a delta is
emitted, prefix_offset moves to the old read_offset, a boundary where the decoder's state is clean, so the window
stays a few tokens long. Invariant: text + held back part == tokenizer.decode(ids) (for byte-level BPE exactly;
finish() flushes what is held, e.g. a genuinely invalid byte at the very end).
"""
from __future__ import annotations

from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, **kwargs: bool) -> str: ...


class IncrementalDetokenizer:
    """add(token_id) -> new text (possibly ""); finish() -> the held-back rest. The text itself is kept by the caller
    (the request's `Req.text`, which stops cut), not here.

    prompt_ids (optional) give the first output tokens their left context, for tokenizers whose decoding of a
    token depends on what precedes it; they are never part of the output text. spaces_between_special_tokens=False
    is passed on to decode (True, the default, is decode's own default and is not passed).
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
        context_len: int = 5,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_kwargs = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        self.ids: list[int] = list(prompt_ids[-context_len:]) if prompt_ids else []
        self.num_prompt_ids = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    @property
    def output_ids(self) -> list[int]:
        return self.ids[self.num_prompt_ids :]

    def add(self, token_id: int) -> str:
        """Append one token id; return the text it completes (may be "" while a character is incomplete)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def add_many(self, token_ids: Sequence[int]) -> str:
        """Append several ids at once (one decode); same total text as calling add() on each."""
        self.ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flush the held-back text (a trailing incomplete character comes out as U+FFFD, as decode() gives it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            if final:
                self.prefix_offset = self.read_offset = len(self.ids)
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **self._decode_kwargs)
