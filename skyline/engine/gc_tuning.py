"""Garbage-collector settings for processes that run a loop over many requests (the engine
core, and the API process that streams their outputs). They live in worker/gc_tuning.py, since
every rank of a parallel model runs a step loop too and worker/ does not import engine/; the
server and the engine take them from here. No torch here: the API process imports it."""

from __future__ import annotations

from skyline.worker.gc_tuning import GC_THRESHOLD0, fewer_collections, tune_gc

__all__ = ["GC_THRESHOLD0", "fewer_collections", "tune_gc"]
