"""The garbage collector's full passes in a long-lived serving process: off the startup heap, and at quiet moments
(ARCHITECTURE §2).

A full (generation-2) collection walks every tracked object, and the process stands still meanwhile. After startup
the engine process holds ~177k of them (torch, the model), the HTTP process ~45k (starlette, the tokenizer): on the
shared 2-core box a full pass took ~200 ms in the engine (model S, 2,000 requests waiting) and ~50 ms in the HTTP
process, a stall of every request in flight, and a few such passes per run are a p99 (issue 41's light tenant).
`gc.freeze()` moves what startup built into the permanent generation, which later passes skip: they walk only what
was allocated since (requests, tree nodes): ~33k objects and ~45 ms for that engine.

That still leaves the requests themselves. An open stream in the HTTP process is ~156 tracked objects (coroutines,
cells, contexts, tasks) that live as long as it waits, so under a backlog of ~700 open streams CPython's own rule
(a full pass whenever the old generation grew by 25%) ran one every ~8 s, each 55-128 ms. `FullPasses` turns that
rule off and runs the pass itself: when the process is quiet (nothing in flight: the heap is small and no one
waits), or when the old generation has grown to `growth` times its size after the last pass (sampled every
`check_every_s`). Under a steady backlog the old generation is mostly still-open requests, and the cycles among
what has ended are few (~2k objects per pass in that backlog), so it reaches 4x rarely, and memory stays within
4x of the live heap or 2M objects, as CPython's rule keeps it within 1.25x. The floor matters: from a 50k floor the
tenants bench's growing backlog (model S: ~1,800 open streams by a phase's end) still brought a pass into two
phases of three, whose light p99 were 75 and 46 ms against 37 ms in the one without.
"""
from __future__ import annotations

import gc
import time

NEVER = 2**31 - 1  # a generation-2 threshold that CPython's count never reaches
MIN_YOUNG_PASSES = 10  # CPython's own generation-2 threshold: young passes since the last full one
MIN_OLD_OBJECTS = 500_000  # the growth is counted from at least this (~50-100 MB of objects): below 2M, busy waits


class FullPasses:
    """Who decides when a full collection runs, instead of CPython's 25%-growth rule (see the module doc)."""

    def __init__(self, growth: float = 4.0, check_every_s: float = 5.0) -> None:
        self.growth = growth
        self.check_every_s = check_every_s
        self.checked = time.monotonic()
        self.base = 0  # old-generation objects after the last pass
        self.passes = 0  # full passes this object ran (gc_full_passes in stats)
        self.pause_s = 0.0  # their total time

    def install(self) -> None:
        """Freeze the startup heap and take over generation 2 (the young generations keep CPython's thresholds)."""
        gc.collect()
        gc.freeze()  # what startup built: never walked again
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, NEVER)
        self.base = len(gc.get_objects(generation=2))

    def tick(self, quiet: bool) -> bool:
        """Run a full pass if one is due: quiet, or the old generation grown `growth` times; True if it ran."""
        if gc.get_count()[2] < MIN_YOUNG_PASSES:
            return False  # little reached the old generation since the last pass
        now = time.monotonic()
        if not quiet:
            if now - self.checked < self.check_every_s:
                return False
            self.checked = now
            if len(gc.get_objects(generation=2)) < self.growth * max(self.base, MIN_OLD_OBJECTS):
                return False
        gc.collect()
        self.base = len(gc.get_objects(generation=2))
        self.passes += 1
        self.pause_s += time.monotonic() - now
        return True

    def stats(self) -> dict[str, float]:
        return {"gc_frozen_objects": gc.get_freeze_count(), "gc_full_passes": self.passes,
                "gc_full_pass_s": self.pause_s}
