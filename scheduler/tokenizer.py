"""Tokenizer: a checkpoint's tokenizer on the `tokenizers` library and jinja2 alone (local files only).

The HTTP process tokenizes prompts and renders chat templates, and must not import torch; transformers always imports
it, so this reads the checkpoint's files itself (tokenizer_files.py) and reproduces what transformers 5's
AutoTokenizer does with them:

* tokenizer.json is the pipeline (normalizer, pre-tokenizer, model, post-processor, decoder, added tokens), as the
  generic TokenizersBackend (PreTrainedTokenizerFast) uses it; for Qwen2Tokenizer checkpoints (declared, or forced by
  transformers for model_type qwen2) its vocabulary and merges go under Qwen2Tokenizer's own pre-tokenizer;
* tokenizer_config.json names the special tokens (strings, or ``{"content": ...}`` dicts), may re-declare added tokens
  (``added_tokens_decoder``), sets ``split_special_tokens`` and ``clean_up_tokenization_spaces``, and holds the chat
  template unless chat_template.jinja does (chat_template.py); special_tokens_map.json fills in the special tokens
  when the config has no ``added_tokens_decoder`` (transformers' legacy path);
* special tokens missing from the vocabulary are added as transformers adds them, so ids and len() agree.

encode(text, add_special_tokens) and decode(ids, skip_special_tokens) equal transformers' calls of the same names;
chat messages are rendered with the checkpoint's template and tokenized without adding special tokens, which is what
apply_chat_template(tokenize=True) does. EOS ids come from generation_config.json (an int or a list) plus the eos
token; so does default_max_new_tokens (its max_new_tokens), the reply length of a request that sets none.

Anything else (no tokenizer.json, i.e. sentencepiece only; another model-specific tokenizer class such as
GPT2Tokenizer or a sentencepiece LlamaTokenizer, which transformers rebuilds its own way; remote code) falls back to
transformers' AutoTokenizer, logged at INFO, and that imports torch. Thread safety: the `tokenizers` Tokenizer is
configured once at load (no truncation, no padding) and never mutated afterwards, so encode/decode take no lock;
only the transformers fallback does. A GGUF file's tokenizer is read from the directory gguf_tokenizer.py builds.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Mapping, Sequence

from ..kernels.gguf_file import is_gguf_path
from .chat_template import ChatRenderer, load_chat_templates, select_template
from .gguf_tokenizer import gguf_tokenizer_dir
from .tokenizer_files import declared_class, load_tokenizer_json, pipeline_kind, read_json

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# apply_chat_template options of transformers that are not template variables; ours always tokenizes.
_NOT_TEMPLATE_VARIABLES = frozenset({
    "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "continue_final_message", "return_assistant_tokens_mask", "sanitize_control_tokens", "conversation",
})


class Tokenizer:
    """The tokenizer of the checkpoint directory `path`; see the module docstring for what is read from where."""

    def __init__(self, path: str) -> None:
        if is_gguf_path(path):
            path = gguf_tokenizer_dir(path)
        if not os.path.isdir(path):
            raise ValueError(f"tokenizer path {path!r} is not a directory")
        if not any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
            raise ValueError(
                f"{path!r} has no tokenizer files (expected one of: {', '.join(_TOKENIZER_FILES)})"
            )
        self.path = path
        self._hf: Any = None
        self._hf_lock = threading.Lock()
        config = read_json(os.path.join(path, "tokenizer_config.json")) or {}
        kind = pipeline_kind(path, config)
        if kind is not None:
            self._backend: _Backend = _RustBackend(path, config, qwen2=kind == "qwen2")
        else:
            why = "has no tokenizer.json" if not os.path.isfile(os.path.join(path, "tokenizer.json")) else \
                f"declares the tokenizer class {declared_class(path, config)!r}, which transformers builds its own way"
            logger.info("%s %s: loading transformers' AutoTokenizer (this imports torch)", path, why)
            self._backend = _TransformersBackend(path)
            self._hf = self._backend.hf
        backend = self._backend
        self._templates = load_chat_templates(path, config) if isinstance(backend, _RustBackend) \
            else backend.hf.chat_template
        self._renderer = ChatRenderer()
        self.vocab_size: int = backend.size
        self.bos_token: str | None = backend.named.get("bos_token")
        self.eos_token: str | None = backend.named.get("eos_token")
        self.bos_token_id: int | None = backend.token_id(self.bos_token)
        self.pad_token_id: int | None = backend.token_id(backend.named.get("pad_token"))
        self.special_token_ids: frozenset[int] = backend.special_ids
        # Added tokens (special or not, e.g. <tool_call>) are matched before BPE: text never merges across them.
        self.added_token_ids: frozenset[int] = backend.added_ids
        generation = _generation_config(path)
        self.eos_token_ids: list[int] = _eos_token_ids(path, generation, backend.token_id(self.eos_token))
        # generation_config.json's max_new_tokens: the default reply length wherever a request sets none.
        self.default_max_new_tokens: int | None = generation_max_new_tokens(path, generation)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The template source (or named sources), as transformers' tokenizer.chat_template."""
        return self._templates

    def set_chat_template(self, source: str) -> None:
        """Use `source` (Jinja) instead of the checkpoint's own template (`serve --chat-template FILE`).
        Call before serving: rendering reads the template without a lock."""
        if not source.strip():
            raise ValueError("the chat template is empty")
        self._templates = source

    @property
    def hf(self) -> Any:
        """transformers' AutoTokenizer for the same files, loaded on first use. It imports torch: for tests and
        tools that compare against transformers, never for the serving path."""
        with self._hf_lock:
            if self._hf is None:
                self._hf = _auto_tokenizer(self.path)
            return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """As transformers' decode. spaces_between_special_tokens=False reaches only the transformers fallback
        (its slow, sentencepiece tokenizers use it; True leaves their own default); transformers' tokenizers-library
        backend ignores the option, and so does ours."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens, spaces_between_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._backend.convert_ids_to_tokens([int(i) for i in ids])

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for messages (and tools), as transformers renders it.

        template_kwargs become template variables (e.g. enable_thinking=False), overriding the special tokens;
        chat_template=<name or source> picks a template, like transformers' argument of that name."""
        if not self.has_chat_template and "chat_template" not in template_kwargs:
            raise ValueError(f"the tokenizer in {self.path!r} has no chat template; send a plain prompt instead")
        bad = sorted(_NOT_TEMPLATE_VARIABLES.intersection(template_kwargs))
        if bad:
            raise TypeError(f"unsupported chat template option(s): {', '.join(bad)}")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        tools = tools or None
        source = select_template(self._templates, tools, template_kwargs.pop("chat_template", None))
        variables = {**self._backend.named, **template_kwargs}
        return self._renderer.render(source, messages, tools, add_generation_prompt, variables)

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


class _Backend:
    size: int
    named: dict[str, str]  # the named special tokens that are set: bos_token, ..., and model-specific ones
    special_ids: frozenset[int]

    def token_id(self, token: str | None) -> int | None: ...
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> str: ...
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


class _RustBackend(_Backend):
    def __init__(self, path: str, config: Mapping[str, Any], qwen2: bool = False) -> None:
        tok, named, extra = load_tokenizer_json(path, config, qwen2)
        self._tok = tok
        self.size = tok.get_vocab_size(with_added_tokens=True)
        self.named = named
        self._unk_id = self.token_id(self.named.get("unk_token"))
        ids = (self.token_id(t) for t in dict.fromkeys([*named.values(), *extra]))
        self.special_ids = frozenset(i for i in ids if i is not None)
        self.added_ids = frozenset(tok.get_added_tokens_decoder())
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(tok.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )

    def token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self._tok.token_to_id(token)
        return found if found is not None else getattr(self, "_unk_id", None)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> str:
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) for i in ids]


class _TransformersBackend(_Backend):
    """Pipelines that tokenizer_files does not rebuild (e.g. sentencepiece only): transformers' own, with torch."""

    def __init__(self, path: str) -> None:
        self.hf = _auto_tokenizer(path)
        self._lock = threading.Lock()  # transformers' tokenizers switch truncation/padding state per call
        self.size = len(self.hf)
        self.named = {key: str(value) for key, value in self.hf.special_tokens_map.items()}
        self.special_ids = frozenset(i for i in self.hf.all_special_ids if i is not None)
        self.added_ids = frozenset(self.hf.added_tokens_decoder)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.convert_tokens_to_ids(token)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool = True) -> str:
        with self._lock:
            if spaces_between_special_tokens:  # transformers' own default for this tokenizer class
                return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        with self._lock:
            return list(self.hf.convert_ids_to_tokens(ids))


def _auto_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer in {path!r}: {exc}") from exc


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization (for WordPiece-style vocabularies; not applied to BPE).
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _generation_config(path: str) -> dict:
    return read_json(os.path.join(path, "generation_config.json")) or {}


def generation_max_new_tokens(path: str, generation: dict | None = None) -> int | None:
    """max_new_tokens of path/generation_config.json (a positive int), else None (a bad value is logged);
    generation: that file's contents when the caller has read it already."""
    value = (_generation_config(path) if generation is None else generation).get("max_new_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        logger.warning("ignoring max_new_tokens=%r in %s/generation_config.json (not a positive integer)", value, path)
        return None
    return value


def _eos_token_ids(path: str, generation: dict, tokenizer_eos: int | None) -> list[int]:
    ids: set[int] = set() if tokenizer_eos is None else {int(tokenizer_eos)}
    value = generation.get("eos_token_id")
    if isinstance(value, int):
        ids.add(value)
    elif isinstance(value, list):
        ids.update(int(v) for v in value)
    if not ids:
        logger.warning("no EOS token id in %s (tokenizer or generation_config.json); generation stops only at limits", path)
    return sorted(ids)
