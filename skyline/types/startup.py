"""Seconds of each start-up phase, recorded where the phase runs and carried as plain data.

The runner records its phases (weights, profiling, KV cache, CUDA graphs), the engine-core
process adds its own around them (spawn and imports, config, the engine's other parts), the
API process the tokenizer and the server; `describe` and the engine's info carry the merged
record, `skyline serve` logs it once it serves, and bench/fast_start.py reports it. The
phases of one record do not overlap, so that they add up to about the whole start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupPhases:
    """Phase name -> seconds, in the order the phases first ran."""

    def __init__(self, seconds: dict[str, float] | None = None) -> None:
        self.seconds: dict[str, float] = dict(seconds or {})

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` (added to its earlier time, if it ran before)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def update(self, other: dict[str, float]) -> None:
        for name, seconds in other.items():
            self.add(name, seconds)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def format_phases(seconds: dict[str, float]) -> str:
    """One line for a log: "weights 2.40 s, cuda_graphs 9.70 s, ..." (the phases in order)."""
    return ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items())


def expand(seconds: dict[str, float], name: str, inner: dict[str, float]) -> dict[str, float]:
    """`seconds` with phase `name` replaced, where it stood, by the phases `inner` it was made
    of and their remainder as "<name>_other" (what `inner` did not record)."""
    out: dict[str, float] = {}
    for key, s in seconds.items():
        if key != name:
            out[key] = out.get(key, 0.0) + s
            continue
        for k, v in inner.items():
            out[k] = out.get(k, 0.0) + v
        out[f"{name}_other"] = max(0.0, s - sum(inner.values()))
    return out


def process_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc; None elsewhere), at the kernel
    clock's resolution (10 ms): the interpreter's start and the imports before a first timer."""
    try:
        with open("/proc/self/stat") as f:  # field 22, after the parenthesized name
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
