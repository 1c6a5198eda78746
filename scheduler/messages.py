"""Typed messages between the HTTP process and the engine process (ARCHITECTURE §2).

Torch-free: both processes import this module. The HTTP process sends requests and controls;
the engine process answers with one `EngineEvents` per loop iteration, which batches every
admission decision and every request's new tokens, text and finish of that step (never one
message per token per request). Messages are pickled (both ends are this package, over
`ipc://` sockets in a private directory).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from .req import StreamDelta
from .sampling_params import SamplingParams


# -- HTTP process -> engine process -------------------------------------------------------------

@dataclass
class AddRequest:
    """`n` choices of one prompt (sampling_params.choice_rids / choice_seed name and seed them)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Call:
    """Run an engine method between steps (`stats`, `flush_cache`, `check_integrity`, `open_session`,
    `close_session`) with `args`, and reply."""

    call_id: int
    name: str
    args: tuple = ()


@dataclass
class Shutdown:
    """Finish (abort) whatever is in flight and exit."""


# -- engine process -> HTTP process -------------------------------------------------------------

@dataclass
class EngineInfo:
    """What the HTTP side needs to know about the loaded engine (sent once, when ready)."""

    model_path: str
    context_length: int
    vocab_size: int
    total_slots: int
    page_size: int
    max_running_requests: int
    engine_config: dict[str, Any]
    pid: int
    attention: str = ""  # what reads the KV pool: "native avx512", "torch flash op", "triton" (runner.attention_path)
    structured: bool = True  # xgrammar is installed: grammars (regex, JSON schemas, forced tool calls) can be compiled


@dataclass
class Ready:
    info: EngineInfo


@dataclass
class LoadFailed:
    message: str  # one line: the engine's ValueError (bad checkpoint, bad setting)


@dataclass
class Rejected:
    """A request the engine refused (validation): becomes a 400 before any byte is sent."""

    rid: str
    message: str
    param: str | None = None
    code: str | None = None


@dataclass
class Reply:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class EngineEvents:
    """Everything one engine loop iteration has to say, in one message."""

    accepted: list[str] = field(default_factory=list)  # rids queued in the engine
    rejected: list[Rejected] = field(default_factory=list)
    deltas: list[StreamDelta] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    num_steps: int = 0  # the engine's step counter: progress for the watchdog
    # After a step: KV slots held by each tenant's running requests (Engine.tenant_slots; the HTTP side's
    # max_kv_share limit reads the latest); None in a message sent between steps.
    tenant_slots: dict[str, int] | None = None

    def __bool__(self) -> bool:
        return bool(self.accepted or self.rejected or self.deltas or self.replies)


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)
