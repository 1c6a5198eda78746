"""`@function` programs and how they run: one at a time, streamed, or many in parallel."""
from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import logging
import threading
from typing import Any, Callable

from .backend import Backend
from .state import ProgramState

logger = logging.getLogger(__name__)


class _DefaultBackend:
    """Holder for set_default_backend; the one piece of process-wide state the DSL keeps,
    because programs written for SGLang's API expect it."""

    def __init__(self) -> None:
        self.backend: Backend | None = None
        self.lock = threading.Lock()


_DEFAULT = _DefaultBackend()


def set_default_backend(backend: Backend | None) -> None:
    """Backend used by `.run()` / `.run_batch()` when none is passed."""
    with _DEFAULT.lock:
        _DEFAULT.backend = backend


def get_default_backend() -> Backend | None:
    with _DEFAULT.lock:
        return _DEFAULT.backend


class SglFunction:
    """A program: a function whose first parameter is the state `s`."""

    def __init__(self, func: Callable[..., Any]) -> None:
        params = list(inspect.signature(func).parameters)
        if not params:
            raise ValueError(f"program {func.__name__} must take the state `s` as its first parameter")
        self.func = func
        self.arg_names = params[1:]
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def run(self, *args: Any, backend: Backend | None = None, stream: bool = False,
            max_new_tokens: int = 128, stop: str | list[str] | None = None, temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
            presence_penalty: float = 0.0, ignore_eos: bool = False, seed: int | None = None,
            **kwargs: Any) -> ProgramState:
        """Run the program; keyword arguments other than these go to the program function.
        The sampling arguments are the defaults of every gen in it (a gen's own values win).
        With stream=True it returns at once; read `state.text_iter()` while it runs."""
        defaults = _sampling_defaults(max_new_tokens, stop, temperature, top_p, top_k, min_p,
                                      frequency_penalty, presence_penalty, ignore_eos, seed)
        return self._run(args, kwargs, _resolve(backend), defaults, stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  max_new_tokens: int = 128, stop: str | list[str] | None = None, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                  presence_penalty: float = 0.0, ignore_eos: bool = False,
                  seed: int | None = None) -> list[ProgramState]:
        """Run the program once per kwargs dict, `num_threads` at a time; states in input order.
        The programs' requests reach the backend concurrently, so the engine batches them."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise ValueError("run_batch takes a list of keyword-argument dicts, one per program run")
        if not batch_kwargs:
            return []
        if num_threads == "auto":
            num_threads = min(len(batch_kwargs), 64)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive integer or 'auto', got {num_threads!r}")
        backend_obj = _resolve(backend)
        defaults = _sampling_defaults(max_new_tokens, stop, temperature, top_p, top_k, min_p,
                                      frequency_penalty, presence_penalty, ignore_eos, seed)
        states: list[ProgramState | None] = [None] * len(batch_kwargs)
        with concurrent.futures.ThreadPoolExecutor(max_workers=num_threads) as pool:
            futures = {pool.submit(self._run, (), dict(kw), backend_obj, defaults, False): i
                       for i, kw in enumerate(batch_kwargs)}
            done_iter = concurrent.futures.as_completed(futures)
            if progress_bar:
                from tqdm.auto import tqdm

                done_iter = tqdm(done_iter, total=len(futures), desc=self.__name__)
            for future in done_iter:
                idx = futures[future]
                try:
                    states[idx] = future.result()
                except Exception as exc:
                    raise _with_context(exc, f"program {self.__name__} #{idx} of the batch failed") from exc
        return states  # type: ignore[return-value]

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _run(self, args: tuple, kwargs: dict[str, Any], backend: Backend, defaults: dict[str, Any],
             stream: bool) -> ProgramState:
        session = backend.open_session()  # the run is a session: its history stays cached between its calls
        if session is not None:
            defaults = dict(defaults, session_id=session)
        state = ProgramState(backend, defaults, stream=stream)
        state._session = session
        if stream:
            threading.Thread(target=self._body, args=(state, args, kwargs), daemon=True,
                             name=f"radixserve-lang-{self.__name__}").start()
            return state
        self._body(state, args, kwargs)
        state.sync()
        return state

    def _body(self, state: ProgramState, args: tuple, kwargs: dict[str, Any]) -> None:
        error: BaseException | None = None
        try:
            self.func(state, *args, **kwargs)
        except BaseException as exc:  # stored for text_iter()/sync() when streaming
            error = exc
            if not state._stream:
                state._mark_finished(exc)
                raise
        finally:
            if state._session is not None:
                with contextlib.suppress(Exception):  # a failed call is the run's error, raised above
                    state.sync()  # the calls it made have ended
                state.backend.close_session(state._session)
        state._mark_finished(error)


def function(func: Callable[..., Any]) -> SglFunction:
    """Decorator: `@function def prog(s, question): s += ...`."""
    return SglFunction(func)


def _with_context(exc: Exception, context: str) -> Exception:
    try:
        return type(exc)(f"{context}: {exc}")
    except Exception:  # an exception type whose constructor takes other arguments
        return RuntimeError(f"{context}: {type(exc).__name__}: {exc}")


def _resolve(backend: Backend | None) -> Backend:
    backend = backend if backend is not None else get_default_backend()
    if backend is None:
        raise ValueError("no backend: pass backend=Runtime(...) or Endpoint(url), or call set_default_backend")
    return backend


def _sampling_defaults(max_new_tokens: int, stop: str | list[str] | None, temperature: float, top_p: float,
                       top_k: int, min_p: float, frequency_penalty: float, presence_penalty: float,
                       ignore_eos: bool, seed: int | None) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "min_p": min_p, "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
    }
    if stop is not None:
        defaults["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if seed is not None:
        defaults["seed"] = seed
    return defaults
