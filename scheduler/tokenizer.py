"""Tokenizer: a thin, thread-safe wrapper over a checkpoint's transformers tokenizer (local files only).

Text is tokenized exactly as transformers would (encode(text, add_special_tokens=True)); chat messages are
rendered with the checkpoint's own chat template and tokenized without adding special tokens, which is what
transformers' apply_chat_template(tokenize=True) does. EOS ids come from generation_config.json (an int or a list)
plus the tokenizer's eos token.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any, Sequence

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer:
    """Wraps AutoTokenizer.from_pretrained(path, local_files_only=True).

    Fast tokenizers are not safe to call from several threads at once (encode mutates padding/truncation
    state), and the HTTP thread and the engine thread both use this object, so every call takes a lock.
    """

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer path {path!r} is not a directory")
        if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
            raise ValueError(
                f"{path!r} has no tokenizer files (expected one of: {', '.join(_TOKENIZER_FILES)})"
            )
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer in {path!r}: {exc}") from exc
        self.path = path
        self._lock = threading.RLock()
        self.eos_token_ids: list[int] = _eos_token_ids(path, self.hf.eos_token_id)
        self.vocab_size: int = len(self.hf)
        self.bos_token_id: int | None = self.hf.bos_token_id
        self.pad_token_id: int | None = self.hf.pad_token_id
        self.special_token_ids: frozenset[int] = frozenset(self.hf.all_special_ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        with self._lock:
            return list(self.hf.convert_ids_to_tokens(list(ids)))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for messages (and tools), as transformers renders it."""
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer in {self.path!r} has no chat template; send a plain prompt instead")
        with self._lock:
            return self.hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False,
                **template_kwargs,
            )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the rendered chat, equal to transformers' apply_chat_template(..., tokenize=True)."""
        text = self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def _eos_token_ids(path: str, tokenizer_eos: int | None) -> list[int]:
    ids: set[int] = set() if tokenizer_eos is None else {int(tokenizer_eos)}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path, encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {gen_path}: {exc}") from exc
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if not ids:
        logger.warning("no EOS token id in %s (tokenizer or generation_config.json); generation stops only at limits", path)
    return sorted(ids)
