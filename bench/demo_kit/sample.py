"""One training sample of the demo corpus."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    # Per assistant message (in order): [(text, trainable), ...] pieces whose concatenation is its content,
    # or None to train on the whole message. Tool-call messages are always trained on whole.
    pieces: list[list[tuple[str, bool]] | None] = field(default_factory=list)
    text: str | None = None  # a raw-text sample (no chat template), trained on entirely
