"""The startup heap of a long-lived process, kept out of the garbage collector's full passes (ARCHITECTURE §2).

A full (generation-2) collection walks every tracked object, and the process stands still meanwhile. After startup
the engine process holds ~177k of them (torch, the model), the HTTP process ~45k (starlette, the tokenizer): on the
shared 2-core box a full pass took ~200 ms in the engine (model S, 2,000 requests waiting) and ~50 ms in the HTTP
process, a stall of every request in flight, and a few such passes per run are a p99 (issue 41's light tenant).
`gc.freeze()` moves what startup built into the permanent generation, which later passes skip: they walk only what
was allocated since (requests, tree nodes): ~33k objects and ~45 ms for that engine.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survives; returns how many objects are frozen (gc_frozen_objects)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
