"""Program state: `s += expr` queues work, reads (`s[name]`, `s.text()`) wait for it.

Each state runs its queued expressions in order on a worker thread of its own (started when
work arrives, gone when the queue is empty). The program function therefore never waits on the
model until it reads a result, and fork branches written as a plain loop
(`for f in forks: f += gen(...)`) still run concurrently, so their requests batch in the engine.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
from typing import Any, Iterator

from .backend import Backend, BackendError, RequestRecord
from .ir import Expr, Gen, RoleBegin, RoleEnd, Select, Text, as_expr, convert_typed, flatten
from .roles import Conversation

logger = logging.getLogger(__name__)


class ProgramState:
    """The state `s` a program function receives."""

    def __init__(self, backend: Backend, defaults: dict[str, Any], text: str = "",
                 conversation: Conversation | None = None, variables: dict[str, Any] | None = None,
                 stream: bool = False, typed: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self._stream = stream  # stream gen text as it arrives (else each gen appends once, at its end)
        self._defaults = dict(defaults)
        self._conv = conversation if conversation is not None else Conversation(backend.chat_template)
        self._text = text
        self._variables: dict[str, Any] = dict(variables or {})
        self._typed: dict[str, Any] = dict(typed or {})  # typed gens' values (s[name] stays the text)
        self._meta: dict[str, dict[str, Any]] = {}
        self._requests: list[RequestRecord] = []
        self._num_calls = 0  # backend calls made, for RequestRecord.call_idx
        self._events: list[tuple[str | None, str]] = []  # (variable or None, appended text), for streaming
        self._pending: collections.deque[Expr] = collections.deque()
        self._cond = threading.Condition()
        self._running = False
        self._finished = False  # the program function returned (set by the runner)
        self._error: BaseException | None = None

    # --- appending ------------------------------------------------------------------------

    def __iadd__(self, expr: Expr | str) -> "ProgramState":
        self._submit(flatten(as_expr(expr)))
        return self

    @contextlib.contextmanager
    def _role(self, role: str) -> Iterator["ProgramState"]:
        self._submit([RoleBegin(role)])
        yield self
        self._submit([RoleEnd(role)])

    def system(self) -> contextlib.AbstractContextManager["ProgramState"]:
        return self._role("system")

    def user(self) -> contextlib.AbstractContextManager["ProgramState"]:
        return self._role("user")

    def assistant(self) -> contextlib.AbstractContextManager["ProgramState"]:
        return self._role("assistant")

    # --- reading (each waits for the queued work) -------------------------------------------

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._variables:
            raise KeyError(f"no variable {name!r} in this program state (have: {sorted(self._variables)})")
        return self._variables[name]

    def get_var(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._variables.get(name, default)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._variables[name] = value
        self._typed.pop(name, None)

    def get_typed(self, name: str) -> Any:
        """The value of a typed gen (`gen(name, dtype=int)`, `gen_int`, ...): an int, float, bool or
        the str between the quotes; `s[name]` is its text, as in SGLang. After a fork's join, the
        list of the branches' values. Any other variable is returned as `s[name]` returns it."""
        self.sync()
        if name in self._typed:
            return self._typed[name]
        return self[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """Details of the gen/select that set `name`: finish reason, token counts, choice scores."""
        self.sync()
        return self._meta.get(name, {})

    def text(self) -> str:
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._conv.messages]

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request this state (and its joined forks) sent, in order."""
        self.sync()
        return list(self._requests)

    def sync(self) -> None:
        """Wait for the queued expressions; re-raise the first failure."""
        with self._cond:
            while self._running or self._pending:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is appended (only that of variable `var_name` if given), until the program ends."""
        idx = 0
        while True:
            with self._cond:
                while idx >= len(self._events) and not self._done():
                    self._cond.wait()
                new = self._events[idx:]
                idx = len(self._events)
                done = self._done()
            for var, chunk in new:
                if var_name is None or var == var_name:
                    yield chunk
            if done and idx >= len(self._events):
                break
        self.sync()

    # --- fork / join ----------------------------------------------------------------------

    def fork(self, num_branches: int, cache_prefix: bool = True) -> "ProgramStateGroup":
        """`num_branches` copies of this state. The shared prefix is sent once as a prefix-only
        request (max_new_tokens=0) first, so that every branch's first request hits the cache."""
        if num_branches < 1:
            raise ValueError(f"fork needs at least one branch, got {num_branches}")
        self.sync()
        if cache_prefix and num_branches > 1 and self._text:
            out = _call(self.backend, "fork prefix", lambda: self.backend.prefill_only(self._text))
            self._record([RequestRecord("prefix", self._text, out)])
        branches = [ProgramState(self.backend, self._defaults, self._text, self._conv.copy(), self._variables,
                                 self._stream, self._typed) for _ in range(num_branches)]
        return ProgramStateGroup(self, branches)

    # --- runner hooks ---------------------------------------------------------------------

    def _mark_finished(self, error: BaseException | None = None) -> None:
        with self._cond:
            if error is not None and self._error is None:
                self._error = error
            self._finished = True
            self._cond.notify_all()

    def _done(self) -> bool:
        return self._finished and not self._running and not self._pending

    # --- the worker -------------------------------------------------------------------------

    def _submit(self, exprs: list[Expr]) -> None:
        with self._cond:
            self._pending.extend(exprs)
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, name="radixserve-lang-state", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._running = False
                    self._cond.notify_all()
                    return
                expr = self._pending.popleft()
                failed = self._error is not None
            if failed:
                continue  # after a failure the rest of the program is skipped; sync() raises it
            try:
                self._execute(expr)
            except BaseException as exc:  # handed to whoever reads the state next
                with self._cond:
                    self._error = exc

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.text)
        elif isinstance(expr, RoleBegin):
            self._replace(self._conv.begin(expr.role, self._text))
        elif isinstance(expr, RoleEnd):
            self._replace(self._conv.end(expr.role, self._text))
        elif isinstance(expr, Gen):
            self._run_gen(expr)
        elif isinstance(expr, Select):
            self._run_select(expr)
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _run_gen(self, expr: Gen) -> None:
        params = {**self._defaults, **expr.params}
        streamed: list[str] = []

        def on_text(chunk: str) -> None:
            streamed.append(chunk)
            self._append(chunk, expr.name)

        prompt = self._text
        label = f"gen({expr.name!r})" if expr.name else "gen"
        callback = on_text if self._stream else None
        out = _call(self.backend, label, lambda: self.backend.generate(prompt, params, callback))
        done = "".join(streamed)
        if out.text.startswith(done):
            self._append(out.text[len(done):], expr.name)
        else:  # the stream disagreed with the final text; the final text wins
            self._replace(prompt + out.text)
        self._record([RequestRecord("gen", prompt, out)])
        typed = None
        if expr.dtype is not None:
            try:
                typed = convert_typed(expr.dtype, out.text)
            except ValueError as exc:
                raise ValueError(f"{label} with dtype={expr.dtype} on {self.backend.name}: the output {exc} "
                                 f"(finish_reason {out.finish_reason!r}, {out.completion_tokens} tokens; "
                                 "is max_tokens too small?)") from None
        if expr.name:
            self._variables[expr.name] = out.text
            if expr.dtype is not None:
                self._typed[expr.name] = typed
            else:
                self._typed.pop(expr.name, None)
            self._meta[expr.name] = {"finish_reason": out.finish_reason, "matched_stop": out.matched_stop,
                                     "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
                                     "completion_tokens": out.completion_tokens}
            if expr.dtype is not None:
                self._meta[expr.name]["dtype"] = expr.dtype

    def _run_select(self, expr: Select) -> None:
        label = f"select({expr.name!r})" if expr.name else "select"
        scores = _call(self.backend, label, lambda: self.backend.score_choices(self._text, expr.choices))
        values = scores.sum_logprobs if expr.method == "sum" else scores.normalized_logprobs
        best = max(range(len(values)), key=values.__getitem__)  # ties: the first choice
        self._record(scores.records)
        self._append(expr.choices[best], expr.name)
        if expr.name:
            self._variables[expr.name] = expr.choices[best]
            self._typed.pop(expr.name, None)
            self._meta[expr.name] = {"choices": scores.choices, "sum_logprobs": scores.sum_logprobs,
                                     "normalized_logprobs": scores.normalized_logprobs,
                                     "num_tokens": scores.num_tokens, "method": expr.method}

    def _record(self, records: list[RequestRecord]) -> None:
        for record in records:
            record.call_idx = self._num_calls
        self._num_calls += 1
        self._requests.extend(records)

    def _append(self, chunk: str, var: str | None = None) -> None:
        if not chunk:
            return
        with self._cond:
            self._text += chunk
            self._events.append((var, chunk))
            self._cond.notify_all()

    def _replace(self, text: str) -> None:
        if text.startswith(self._text):
            self._append(text[len(self._text):])
            return
        with self._cond:  # a re-rendered conversation: streams cannot take the change back
            self._text = text
            self._cond.notify_all()


class ProgramStateGroup:
    """The branches of a fork. `group += expr` appends to every branch; `join()` waits for them."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState]) -> None:
        self._parent = parent
        self._branches = branches
        self._fork_text_len = len(parent._text)
        self._fork_vars = dict(parent._variables)

    def __len__(self) -> int:
        return len(self._branches)

    def __getitem__(self, idx: int) -> ProgramState:
        return self._branches[idx]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self._branches)

    def __iadd__(self, expr: Expr | str) -> "ProgramStateGroup":
        for branch in self._branches:
            branch += expr
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. "gather_variable": each variable a branch set becomes, in the
        parent, the list of the branches' values. "concate_and_append": the branches' new text is
        appended to the parent, in branch order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for branch in self._branches:
            branch.sync()
        parent = self._parent
        parent.sync()
        for branch in self._branches:
            parent._requests.extend(branch._requests)
        if mode == "gather_variable":
            names = {name for b in self._branches for name, value in b._variables.items()
                     if name not in self._fork_vars or value is not self._fork_vars[name]}
            for name in sorted(names):
                parent._variables[name] = [b._variables.get(name) for b in self._branches]
                if any(name in b._typed for b in self._branches):
                    parent._typed[name] = [b._typed.get(name, b._variables.get(name)) for b in self._branches]
                else:
                    parent._typed.pop(name, None)
        else:
            parent += "".join(b._text[self._fork_text_len:] for b in self._branches)


def _call(backend: Backend, label: str, fn: Any) -> Any:
    """Run a backend call; its errors name the expression and the backend."""
    try:
        return fn()
    except BackendError as exc:
        raise BackendError(f"{label} on {backend.name}: {exc}") from exc
    except ValueError as exc:
        raise BackendError(f"{label} on {backend.name} was rejected: {exc}") from exc
