"""Progress bars for long steps (loading, calibration, quantization, searches, training, sweeps),
wherever the work runs: in the CLI's process, or in an engine process whose stderr is the
same terminal. Whether bars show is logging configuration, not a global of ours: the CLI puts
the `skyline.progress` logger at INFO unless `--quiet`, and an engine process it spawns takes
that level; bars never show when stderr is not a terminal (logs, pipes, CI)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tqdm import tqdm

LOGGER = logging.getLogger("skyline.progress")
T = TypeVar("T")


def enabled() -> bool:
    """Whether bars show: asked for (the logger at INFO) and stderr is a terminal."""
    return LOGGER.isEnabledFor(logging.INFO) and sys.stderr.isatty()


def set_enabled(on: bool) -> None:
    """The CLI's `--quiet` switch (the logger's level, inherited by engine processes)."""
    LOGGER.setLevel(logging.INFO if on else logging.WARNING)


class _Silent:
    """A disabled bar. Not a disabled tqdm: every tqdm, disabled or not, takes a
    multiprocessing lock (a semaphore) that a killed process leaves behind."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "") -> None:
        pass

    def close(self) -> None:
        pass


def bar(iterable: Iterable[T] | None = None, total: float | None = None, desc: str = "",
        unit: str = "it", **kw: Any) -> tqdm | _Silent:
    """A tqdm bar on stderr that goes away when done; a silent pass-through when disabled."""
    if not enabled():
        return _Silent(iterable)
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True,
                **kw)
