"""Reading a checkpoint's tokenizer files into a `tokenizers` Tokenizer the way transformers 5's AutoTokenizer does,
without importing transformers (or torch). Used by scheduler/tokenizer.py; see its docstring for the overview.

What is mirrored (transformers/tokenization_utils_base.py, tokenization_utils_tokenizers.py, models/auto and
models/qwen2/tokenization_qwen2.py): which pipeline AutoTokenizer picks for the model types this engine serves, the
precedence of tokenizer_config.json, special_tokens_map.json and added_tokens_decoder for the special tokens, the
tokens it adds to the vocabulary, and Qwen2Tokenizer's own normalizer, pre-tokenizer and decoder.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERIC_CLASSES = frozenset({"PreTrainedTokenizer", "PreTrainedTokenizerFast", "TokenizersBackend", "PythonBackend"})
_GENERIC_TYPES = frozenset({"llama", "mistral", "mixtral"})
_QWEN2_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
_FORCED_QWEN2_TYPES = frozenset({"qwen2"})
_QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def load_tokenizer_json(path: str, config: Mapping[str, Any], qwen2: bool) -> tuple[Any, dict[str, str], list[str]]:
    """(tokenizers.Tokenizer, named special tokens incl. model-specific ones, extra special tokens) of `path`."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer

    file = os.path.join(path, "tokenizer.json")
    try:
        tok = RustTokenizer.from_file(file)
    except Exception as exc:  # the Rust side raises a plain Exception on a malformed file
        raise ValueError(f"cannot load {file}: {exc}") from exc
    if qwen2:
        _rebuild_as_qwen2(tok, file, bool(config.get("add_prefix_space") or False))
    # transformers encodes with truncation and padding off (it switches off any saved in the file); we do it
    # once, here, and never touch them again, which is what makes the object safe to share between threads.
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
    named, extra, declared = _special_tokens(path, config, _QWEN2_DEFAULTS if qwen2 else {})
    _add_missing_tokens(tok, named, extra, declared)
    if qwen2:  # Qwen2Tokenizer ends by re-adding every special token with default flags
        contents = dict.fromkeys([*map(_content, named.values()), *map(_content, extra)])
        tok.add_tokens([AddedToken(content, special=True) for content in contents])
    return tok, {key: _content(value) for key, value in named.items()}, [_content(t) for t in extra]


def _special_tokens(path: str, config: Mapping[str, Any],
                    defaults: Mapping[str, str]) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """(named special tokens incl. model-specific ones, extra special tokens, added tokens the config re-declares),
    each token a string or a tokenizers.AddedToken, gathered with transformers' precedence."""
    from tokenizers import AddedToken

    def as_token(value: Any, special: bool | None = None) -> Any:
        if isinstance(value, Mapping) and "content" in value:
            fields = {k: v for k, v in value.items() if k != "__type"}
            if special is not None:
                fields["special"] = special
            return AddedToken(**fields)
        return value

    settings = dict(config)
    declared = {}
    for idx, value in (config.get("added_tokens_decoder") or {}).items():
        declared[int(idx)] = as_token(value)
    if "added_tokens_decoder" not in config:  # the legacy file counts only when the config lists no added tokens
        for key, value in (read_json(os.path.join(path, "special_tokens_map.json")) or {}).items():
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                have = list(settings.get(key) or [])
                settings[key] = have + [as_token(t, special=True) for t in value if t not in have]
            else:
                settings[key] = as_token(value, special=True)
    for key, value in defaults.items():  # the class's defaults for tokens the files leave out
        settings.setdefault(key, value)
    if "additional_special_tokens" in settings and not settings.get("extra_special_tokens"):
        settings["extra_special_tokens"] = settings.pop("additional_special_tokens")
    by_content = {_content(t): t for t in declared.values()}
    named: dict[str, Any] = {}
    for key in _NAMED_TOKENS:
        value = as_token(settings.get(key))
        if isinstance(value, (str, AddedToken)):
            named[key] = by_content.get(_content(value), value)
    extra_value = settings.get("extra_special_tokens")
    extra: list[Any] = []
    model_specific: dict[str, Any] = {}
    if isinstance(extra_value, Mapping):
        model_specific.update({k: as_token(v) for k, v in extra_value.items()})
    elif isinstance(extra_value, (list, tuple)):
        extra = [as_token(v) for v in extra_value]
    for key, value in settings.items():  # e.g. "image_token": "<image>"
        if key.endswith("_token") and key not in _NAMED_TOKENS and key not in model_specific:
            value = as_token(value) if isinstance(value, Mapping) and value.get("__type") == "AddedToken" else value
            if isinstance(value, (str, AddedToken)):
                model_specific[key] = value
    named.update({k: v for k, v in model_specific.items() if v is not None})
    return named, extra, [declared[i] for i in sorted(declared)]


def _add_missing_tokens(tok: Any, named: Mapping[str, Any], extra: list[Any], declared: list[Any]) -> None:
    """Add tokens as transformers' TokenizersBackend.__init__ does: every token the config re-declares (its flags
    win), then the special tokens that the vocabulary still lacks."""
    from tokenizers import AddedToken

    to_add = list(declared)
    known = {t.content for t in tok.get_added_tokens_decoder().values()} | {_content(t) for t in to_add}
    for value in [*named.values(), *extra]:
        if _content(value) not in known:
            to_add.append(value)
            known.add(_content(value))
    named_contents = {_content(v) for v in named.values()}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in named_contents:
            token.special = True
        tokens.append(token)
    if tokens:
        tok.add_tokens(tokens)


def declared_class(path: str, config: Mapping[str, Any]) -> str | None:
    model = read_json(os.path.join(path, "config.json")) or {}
    return config.get("tokenizer_class") or model.get("tokenizer_class")


def pipeline_kind(path: str, config: Mapping[str, Any]) -> str | None:
    """Which pipeline transformers 5's AutoTokenizer builds for these files: "generic" (tokenizer.json as saved),
    "qwen2" (Qwen2Tokenizer: the vocabulary and merges of tokenizer.json under its own normalizer, pre-tokenizer and
    decoder), or None for anything else (other model-specific classes, remote code, no tokenizer.json), which is
    left to transformers itself. Mirrors the choice in transformers/models/auto/tokenization_auto.py for the model
    types this engine serves."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file) or config.get("auto_map"):
        return None
    model_type = (read_json(os.path.join(path, "config.json")) or {}).get("model_type")
    if model_type in _FORCED_QWEN2_TYPES:  # transformers overrides the class these checkpoints declare
        return "qwen2"
    declared = declared_class(path, config)
    if declared is None:
        return "qwen2" if model_type in _QWEN2_TYPES else "generic" if model_type in _GENERIC_TYPES or not model_type \
            else None
    name = declared.removesuffix("Fast")
    if name in _GENERIC_CLASSES:
        return "generic"
    if name == "Qwen2Tokenizer":
        return "qwen2"
    if name == "LlamaTokenizer":  # a byte-level tokenizer.json under a Llama class loads as the generic backend
        with open(file, encoding="utf-8") as f:
            return "generic" if '"ByteLevel"' in f.read() else None
    return None


def _rebuild_as_qwen2(tok: Any, file: str, add_prefix_space: bool) -> None:
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    with open(file, encoding="utf-8") as f:
        model = json.load(f).get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{file}: a Qwen2 tokenizer needs a BPE model, got {model.get('type')!r}")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    tok.model = models.BPE(vocab=model["vocab"], merges=merges, dropout=None, unk_token=None,
                           continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()


def _content(token: Any) -> str:
    return token if isinstance(token, str) else token.content


def read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value
