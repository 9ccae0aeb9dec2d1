"""Triton, where it is installed. CPU-only installs of PyTorch do not bring it: then `triton`
and `tl` are None, every module defines its kernels under `if triton is not None`, and the
dispatchers run their PyTorch references."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from skyline import envs

triton: Any
tl: Any
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def interpreted() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return envs.ENV.triton_interpret


@dataclass
class CompileCount:
    """Triton kernels compiled while a block ran, and the seconds their compilation took. A
    kernel found in Triton's disk cache counts too (its compile is then a load): with a warm
    cache the seconds shrink, not the number."""

    num: int = 0
    seconds: float = 0.0


@contextmanager
def count_compiles() -> Iterator[CompileCount]:
    """Count the Triton compilations of the block (start-up's record of them) through Triton's
    JIT hooks, chained to any already set. Counts nothing without Triton, under its interpreter
    or with a Triton that has no such hooks (before 3.4)."""
    count = CompileCount()
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook") or interpreted():
        yield count
        return
    prev_pre, prev_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    started: list[float] = []

    def pre(**kwargs: Any) -> Any:
        started.append(time.perf_counter())
        return prev_pre(**kwargs) if prev_pre is not None else None

    def post(**kwargs: Any) -> Any:
        if started:  # one compile at a time in this thread: the latest start is its own
            count.seconds += time.perf_counter() - started.pop()
        count.num += 1
        return prev_post(**kwargs) if prev_post is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = pre, post
    try:
        yield count
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = prev_pre, prev_post
