"""Collection thresholds around the engine loop (engine/core.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

from skyline.engine.core import GC_THRESHOLD0, fewer_collections


def test_fewer_collections_raises_the_young_threshold_and_restores_it():
    before = gc.get_threshold()
    with fewer_collections():
        inside = gc.get_threshold()
        assert inside[0] >= GC_THRESHOLD0 and inside[1:] == before[1:]
    assert gc.get_threshold() == before
    try:  # restored on an error too
        with fewer_collections():
            raise KeyError
    except KeyError:
        pass
    assert gc.get_threshold() == before


def test_tune_gc_freezes_the_heap_of_its_process():
    code = ("import gc; from skyline.engine.core import tune_gc, GC_THRESHOLD0; tune_gc(); "
            "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); "
            "assert gc.get_threshold()[0] == GC_THRESHOLD0")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
