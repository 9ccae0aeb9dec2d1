"""Executors: the compute side of an engine (base.py), in this process or one process per rank
(multiproc.py)."""

from __future__ import annotations

from skyline.config import EngineConfig
from skyline.worker.executor.base import Executor, UniProcExecutor

__all__ = ["Executor", "UniProcExecutor", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    """One process for one rank unless asked otherwise; a process per rank beyond that."""
    if config.parallel.world_size == 1 and config.parallel.executor == "uni":
        return UniProcExecutor(config)
    from skyline.worker.executor.multiproc import MultiProcExecutor

    return MultiProcExecutor(config)
