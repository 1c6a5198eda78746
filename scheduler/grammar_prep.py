"""Grammars compiled off the engine loop: a request whose grammar is not cached waits here, not in the step.

The engine process (scheduler/engine_process.py) asks `hold(message)` for every AddRequest. A request
without a grammar, or with one already compiled, is admitted at once; any other is handed to one worker
thread (GrammarBackend.prepare: the compile, and on the compiler's first use the tokenizer's byte table,
which takes seconds) while the loop keeps stepping the running requests. `ready()` returns the held
requests whose preparation finished — with its RequestError for a bad grammar — and the loop admits or
rejects them then, so admission still answers every request exactly once. An abort that arrives while a
request is held is remembered and applied right after its admission.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .sampling_params import choice_rids


class PendingGrammars:
    def __init__(self, grammar: Any) -> None:
        self._grammar = grammar  # a scheduler.grammar.GrammarBackend
        self._pool: ThreadPoolExecutor | None = None
        self._held: dict[str, tuple[Any, Future]] = {}  # message rid -> (AddRequest, its preparation)
        self._choices: dict[str, str] = {}  # the rid of each held choice -> its message's rid
        self._aborted: dict[str, list[str]] = {}  # message rid -> its choices aborted while held

    def hold(self, message: Any) -> bool:
        """True when the request waits for its grammar (now compiling on the worker)."""
        if not message.params.has_grammar or self._grammar.is_cached(message.params):
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._held[message.rid] = (message, self._pool.submit(self._grammar.prepare, message.params))
        self._choices.update((rid, message.rid) for rid in choice_rids(message.rid, message.n))
        return True

    def abort(self, rid: str) -> bool:
        """True when rid is a held choice (it is aborted right after its admission)."""
        owner = self._choices.get(rid)
        if owner is None:
            return False
        self._aborted.setdefault(owner, []).append(rid)
        return True

    def ready(self) -> list[tuple[Any, BaseException | None, list[str]]]:
        """(message, the preparation's error or None, its choices aborted meanwhile) of each request done
        compiling."""
        done = []
        for rid, (message, future) in list(self._held.items()):
            if future.done():
                del self._held[rid]
                for choice in choice_rids(rid, message.n):
                    self._choices.pop(choice, None)
                done.append((message, future.exception(), self._aborted.pop(rid, [])))
        return done

    def drain(self) -> list[Any]:
        """The held messages, given up (the engine is shutting down)."""
        messages = [message for message, _ in self._held.values()]
        self._held.clear()
        self._choices.clear()
        self._aborted.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        return messages

    def __len__(self) -> int:
        return len(self._held)
