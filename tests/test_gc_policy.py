"""scheduler/gc_freeze.FullPasses: CPython's growth rule off, full collections when quiet or after the interval."""
import gc
import weakref

import pytest

from radixserve.scheduler.gc_freeze import MIN_OLD_OBJECTS, MIN_YOUNG_PASSES, NEVER, FullPasses


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only a full (or its own generation's) pass frees it


@pytest.fixture
def restore_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _cycle_in_old_generation() -> weakref.ref:
    node = Node()
    ref = weakref.ref(node)
    for _ in range(2):
        gc.collect(1)  # survives the young passes (still referenced): now in generation 2
    del node
    for _ in range(MIN_YOUNG_PASSES):
        gc.collect(1)  # the young passes do not reach it; each counts toward a full pass being due
    return ref


def test_install_takes_over_generation_two(restore_gc):
    young, middle, _ = gc.get_threshold()
    passes = FullPasses()
    passes.install()
    assert gc.get_threshold() == (young, middle, NEVER)
    assert gc.get_freeze_count() > 0 and passes.stats()["gc_full_passes"] == 0


def test_busy_process_defers_until_the_old_generation_grew_then_collects(restore_gc):
    passes = FullPasses(growth=4.0, check_every_s=0.0)
    passes.install()
    ref = _cycle_in_old_generation()
    assert ref() is not None
    assert not passes.tick(quiet=False)  # in flight and the old generation small: no pause
    assert ref() is not None
    kept = [[i] for i in range(4 * max(passes.base, MIN_OLD_OBJECTS))]  # live objects that reach the old generation
    for _ in range(2):
        gc.collect(1)
    assert passes.tick(quiet=False)  # grown 4x: the bound on what deferring keeps
    assert ref() is None and passes.stats()["gc_full_passes"] == 1
    assert passes.base >= len(kept)  # the next bound counts from what is live now
    del kept


def test_quiet_process_collects_at_once_but_not_without_old_growth(restore_gc):
    passes = FullPasses(check_every_s=0.0)
    passes.install()
    ref = _cycle_in_old_generation()
    assert passes.tick(quiet=True) and ref() is None
    assert not passes.tick(quiet=True)  # nothing reached the old generation since: no pass
    assert passes.stats()["gc_full_passes"] == 1 and passes.stats()["gc_full_pass_s"] >= 0
