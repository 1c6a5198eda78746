"""HTTP serving: OpenAI-compatible and SGLang-native endpoints over the Engine (ARCHITECTURE §9).

Entry points: `radixserve serve` (frontend.cli), `frontend.launch.run_server(ServerConfig)`,
`frontend.server.build_app(build_state(engine, config))` for embedding the app elsewhere.
"""
from __future__ import annotations

import os
import sys


def drop_checkout_root() -> None:
    """Take this source checkout's root off sys.path. `python -m ...` and pytest put the current directory first,
    and from the root of a checkout its folders `kernels/`, `radix/`, ... would shadow the packages of those names
    (transformers imports Hugging Face's `kernels` when it is installed, and would find ours). radixserve itself is
    imported as `radixserve.*` through its install, never through that path. Processes this one spawns inherit
    the cleaned path."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # real paths: a checkout reached by a link
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]


drop_checkout_root()
