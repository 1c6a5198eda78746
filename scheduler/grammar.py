"""Structured generation: grammars compiled with xgrammar, one matcher per constrained request.

Lives in the engine process only: xgrammar imports torch, so it is imported on first use (the HTTP
process imports scheduler modules and must stay torch-free; tests/test_torch_free_imports.py).

- ``GrammarBackend.compile(params)``: the request's ``regex`` / ``json_schema`` / ``ebnf`` compiled
  against the engine's tokenizer (model vocabulary width, so ids past the tokenizer's are never
  allowed), cached by (kind, text) — a schema dict is serialised compactly in its own key order
  (not sorted: the order of ``properties`` is the order of the output's keys), so a repeated
  schema costs a dict lookup. A compile error is a ``RequestError`` naming the field.
  ``Engine.add_request`` compiles synchronously (the cache makes repeats free); the engine process
  compiles a grammar that is not cached yet on a worker thread before it admits the request
  (scheduler/engine_process.py), so a new schema — or the compiler's first use, which builds the
  tokenizer's byte table for seconds — never stalls the running requests' steps. Cache reads never
  wait for a compile in progress (two locks: the cache's and the compiler's).
- ``GrammarBackend.matcher(compiled)``: a fresh ``xgr.GrammarMatcher``; the engine keeps it on
  ``Req.grammar``, fills its row of the step's bitmask before each sampled step, accepts each
  sampled token and drops it when the request finishes.
- ``xgrammar_installed()``: whether there is an xgrammar to compile with (a base dependency only where it
  publishes wheels, pyproject.toml). The engine reports it at start (EngineInfo.structured), so the
  HTTP layer refuses a constraint it cannot honour naming the field the client sent; the RequestError
  of ``compile`` without it is the backstop of in-process Engine users.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from typing import Any

from .errors import RequestError
from .sampling_params import JSON_OBJECT

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[12:47:03] /project/cpp/x.cc:94: " of xgrammar's errors
_CACHE_LIMIT = 1024  # compiled grammars kept (oldest dropped first)


def xgrammar_installed() -> bool:
    """Whether xgrammar can be found (not imported: importing it loads transformers, which an engine that never
    constrains a request does without)."""
    return importlib.util.find_spec("xgrammar") is not None


def grammar_key(params: Any) -> tuple[str, str] | None:
    """(kind, canonical text) of the request's grammar, or None when it has none."""
    for kind in GRAMMAR_KINDS:
        value = getattr(params, kind, None)
        if value is None:
            continue
        if kind in ("json_schema", "structural_tag") and not isinstance(value, str):
            # Not sort_keys: xgrammar emits properties in the schema's order, so two dicts that
            # differ only in key order are different grammars (and must not share a cache entry).
            value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        return kind, value
    return None


class GrammarBackend:
    """Compiles and caches grammars for one tokenizer; hands out matchers. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer  # scheduler.tokenizer.Tokenizer (its .hf is loaded on first compile)
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()  # the cache
        self._compile_lock = threading.Lock()  # the compiler (its creation and each compile)
        self.num_compiled = 0  # cache misses (for tests and stats)
        self._info: Any = None
        self._json_ban: Any = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, params: Any) -> Any | None:
        """The request's compiled grammar (None without one). Raises RequestError."""
        key = grammar_key(params)
        if key is None:
            return None
        with self._lock:
            compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        with self._compile_lock:
            with self._lock:
                compiled = self._cache.get(key)  # compiled by another thread meanwhile
            if compiled is not None:
                return compiled
            compiled = self._compile(*key)
        with self._lock:
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
            self.num_compiled += 1
        return compiled

    def is_cached(self, params: Any) -> bool:
        """Whether compile(params) is a dict lookup (True for a request without a grammar)."""
        key = grammar_key(params)
        with self._lock:
            return key is None or key in self._cache

    def matcher(self, compiled: Any) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def extra_ban(self, params: Any) -> Any | None:
        """A bitmask row to AND into a JSON-schema request's mask, or None: xgrammar's JSON strings
        admit raw control characters (U+0000-U+001F), which strict JSON parsers (Python's
        json.loads, the OpenAI SDKs) refuse; with no free whitespace between JSON tokens
        (any_whitespace=False), no valid output needs a token holding one."""
        key = grammar_key(params)
        if key is None or key[0] != "json_schema":
            return None
        if self._json_ban is None:  # built once (prepare() builds it off the engine loop)
            with self._compile_lock:
                if self._json_ban is None:
                    self._get_compiler(key[0])
                    self._json_ban = _ban_row(self._vocab_size, self._info.decoded_vocab)
        return self._json_ban

    def prepare(self, params: Any) -> None:
        """Everything admission will need, made ready (for a worker thread): the compiled grammar
        and the JSON ban row. Raises RequestError for a bad grammar."""
        self.compile(params)
        self.extra_ban(params)

    def allocate_bitmask(self, num_rows: int) -> Any:  # [num_rows, ceil(vocab / 32)] int32 torch tensor
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self._vocab_size)

    # -----------------------------------------------------------------------------------------

    def _compile(self, kind: str, text: str) -> Any:
        compiler = self._get_compiler(kind)
        try:
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":  # xgrammar's format; its JSON schemas are strict, as json_schema's
                return compiler.compile_structural_tag(text)
            if text == JSON_OBJECT:
                return compiler.compile_builtin_json_grammar()
            try:
                json.loads(text)
            except ValueError as exc:
                raise RequestError(f"json_schema is not valid JSON: {exc}", "json_schema") from None
            return compiler.compile_json_schema(text, any_whitespace=False)
        except RequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
            message = _XGR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
            raise RequestError(f"invalid {kind}: {message}", kind) from None

    def _get_compiler(self, kind: str) -> Any:  # under _compile_lock
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise RequestError(f"{kind} needs xgrammar, which is not installed (see the README's \"Set up "
                                   "on a fresh machine\" for the platforms it installs on)", kind) from None

            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer.hf, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._info = info
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _ban_row(vocab_size: int, decoded_vocab: list[bytes]) -> Any:
    """[ceil(vocab / 32)] int32: every bit set except the tokens whose bytes hold a control character."""
    import torch

    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    for token_id, raw in enumerate(decoded_vocab[:vocab_size]):
        if any(b < 0x20 for b in raw):
            allowed[token_id] = False
    bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    return bits.sum(1).to(torch.int64).add(2**31).remainder(2**32).sub(2**31).to(torch.int32)
