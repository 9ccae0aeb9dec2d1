"""Garbage collection for processes that run a step loop: the engine's, and every rank's."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# Net allocations of container objects between young-generation collections (CPython's
# default is 700). A step at a thousand requests allocates a few thousand short-lived
# containers and frees them before the next: with the default, collections run several times
# a step, and every few dozen steps a full one rescans each request's token lists: a pause the
# device waits out (bench/host_overhead.py times them).
GC_THRESHOLD0 = 20_000


def tune_gc() -> None:
    """For a process that runs an engine loop, once the engine is built: freeze what exists
    (the model, the tokenizer, the modules: nothing to collect, much to scan) and collect the
    young generation less often. Reference counting still frees everything acyclic at once."""
    gc.collect()
    gc.freeze()
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(GC_THRESHOLD0, g0), g1, g2)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """`tune_gc`'s threshold for a while, in a process that is not the engine's own (the
    offline `LLM` runs in the caller's): restored afterwards, nothing frozen."""
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(GC_THRESHOLD0, g0), g1, g2)
    try:
        yield
    finally:
        gc.set_threshold(g0, g1, g2)
