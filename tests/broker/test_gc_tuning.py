"""broker/gc_tuning.py: survivors of a collection are frozen (never rescanned), young cyclic
garbage is still collected, and the full pass frees cycles that died after being frozen."""
from __future__ import annotations

import gc
import weakref

import pytest

from broker.gc_tuning import SurvivorFreezer


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> tuple[_Node, weakref.ref]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


@pytest.fixture()
def freezer():
    before = gc.get_threshold()
    f = SurvivorFreezer()
    f.install()
    try:
        yield f
    finally:
        f.uninstall()
        gc.set_threshold(*before)


def test_survivors_are_frozen_and_older_generations_stay_empty(freezer):
    kept = [_Node() for _ in range(1000)]
    frozen_before = gc.get_freeze_count()
    gc.collect(0)
    assert gc.get_freeze_count() >= frozen_before + 1000
    assert len(gc.get_objects(1)) == 0 and len(gc.get_objects(2)) == 0
    assert all(n is not None for n in kept)


def test_young_cycles_are_still_collected(freezer):
    a, ref = _cycle()
    del a
    gc.collect(0)
    assert ref() is None


def test_full_pass_frees_a_cycle_that_died_after_being_frozen(freezer):
    a, ref = _cycle()
    gc.collect(0)              # survives: frozen
    del a
    gc.collect()               # a collection never scans the frozen cycle
    assert ref() is not None
    took = freezer.full_pass()
    assert ref() is None
    assert took >= 0 and freezer.full_passes == 1
    assert gc.get_freeze_count() > 0          # frozen again after the pass


def test_uninstall_unfreezes():
    f = SurvivorFreezer()
    f.install()
    gc.collect(0)
    assert gc.get_freeze_count() > 0
    f.uninstall()
    assert gc.get_freeze_count() == 0
    assert f._on_gc not in gc.callbacks
