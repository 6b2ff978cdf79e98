"""The services' start-up heap: frozen out of the cyclic collector, which then collects less often."""

import gc

from common.config import Settings
from common.service import freeze_startup_heap


def test_freeze_startup_heap_freezes_and_sets_the_young_threshold():
    before = gc.get_threshold()
    kept = [[] for _ in range(100)]  # tracked objects alive at start-up
    try:
        frozen = gc.get_freeze_count()
        freeze_startup_heap(Settings(gc_young_threshold=12_345).gc_young_threshold)
        assert gc.get_threshold() == (12_345, before[1], before[2])
        assert gc.get_freeze_count() >= frozen + len(kept)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_freeze_startup_heap_without_a_threshold_keeps_pythons():
    before = gc.get_threshold()
    try:
        gc.set_threshold(321, before[1], before[2])
        freeze_startup_heap()
        assert gc.get_threshold() == (321, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
