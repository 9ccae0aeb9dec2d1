"""Triton, where it is installed. CPU-only installs of PyTorch do not bring it: then `triton`
and `tl` are None, every module defines its kernels under `if triton is not None`, and the
dispatchers run their PyTorch references."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

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


def inline_ptx(device: torch.device) -> bool:
    """Whether kernels launched on `device` may inline NVIDIA PTX: compiled (not interpreted),
    on a CUDA device, and not a ROCm build."""
    return not interpreted() and device.type == "cuda" and not torch.version.hip


@dataclass
class CompileCount:
    """Triton kernels compiled while a block ran, the seconds their compilation took, and how
    many of each kernel (by name). A kernel found in Triton's disk cache counts too (its
    compile is then a load): with a warm cache the seconds shrink, not the number."""

    num: int = 0
    seconds: float = 0.0
    kernels: Counter[str] = field(default_factory=Counter)

    def since(self, start: CompileCount) -> CompileCount:
        """The compilations after `start` (a copy of this count taken earlier)."""
        return CompileCount(self.num - start.num, self.seconds - start.seconds,
                            self.kernels - start.kernels)

    def copy(self) -> CompileCount:
        return CompileCount(self.num, self.seconds, Counter(self.kernels))


# Every compilation of this process once `count_compiles` first ran (`compiled_so_far`), and
# the counts of the blocks running now.
_TOTAL = CompileCount()
_ACTIVE: list[CompileCount] = []
# (kernel, its specialization: `_specialization`) of every compilation counted, in order
_SPECS: list[tuple[str, dict[str, str]]] = []


def _specialization(compile_args: dict[str, Any]) -> dict[str, str]:
    """What Triton compiled a kernel for, argument by argument (type, constexpr value, the
    attributes it specialized on: divisibility by 16, or the value 1) and its launch options,
    from the JSON its JIT hook gets; empty where the hook gives none."""
    try:
        obj = json.loads(compile_args["specialization_data"])
        names = list(obj["signature"])
        out = {n: str(t) for n, t in obj["signature"].items()}
        for key, val in zip(obj["constant_keys"], obj["constant_vals"], strict=True):
            out[names[key[0]]] = f"{val}"
        for key, val in zip(obj["attrs_keys"], obj["attrs_vals"], strict=True):
            out[names[key[0]]] += " " + json.dumps(val)
        out |= {o: str(obj["options"].get(o)) for o in ("num_warps", "num_stages", "num_ctas")}
        return out
    except (KeyError, IndexError, TypeError, ValueError):
        return {}


def _hooks_installed() -> bool:
    """Chain this module's hooks to Triton's JIT hooks (once: again only if someone replaced
    them since); False where there are none to chain to (no Triton, its interpreter, or a
    Triton before 3.4)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook") or interpreted():
        return False
    hooks = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    if all(getattr(h, "skyline_counts", False) for h in hooks):
        return True
    prev_pre, prev_post = (None if getattr(h, "skyline_counts", False) else h for h in hooks)
    started: list[float] = []

    def pre(**kwargs: Any) -> Any:
        started.append(time.perf_counter())
        return prev_pre(**kwargs) if prev_pre is not None else None

    def post(**kwargs: Any) -> Any:
        # one compile at a time in this thread: the latest start is its own
        dt = time.perf_counter() - started.pop() if started else 0.0
        name = str(getattr(kwargs.get("fn"), "name", None) or kwargs.get("key", "?"))
        _SPECS.append((name, _specialization(kwargs.get("compile") or {})))
        for count in (_TOTAL, *_ACTIVE):
            count.num += 1
            count.seconds += dt
            count.kernels[name] += 1
        return prev_post(**kwargs) if prev_post is not None else None

    pre.skyline_counts = post.skyline_counts = True  # type: ignore[attr-defined]
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = pre, post
    return True


def compiled_so_far() -> CompileCount:
    """The process's Triton compilations since its first `count_compiles` (a runner's
    start-up): a step that compiles shows as the difference of two copies."""
    return _TOTAL.copy()


def compiled_specs() -> list[tuple[str, dict[str, str]]]:
    """(kernel, specialization) of each compilation `compiled_so_far` counts, in order: what
    made a kernel compile again shows in how its arguments differ from an earlier one."""
    return list(_SPECS)


@contextmanager
def count_compiles() -> Iterator[CompileCount]:
    """Count the Triton compilations of the block (start-up's record of them) through Triton's
    JIT hooks, chained to any set before. Counts nothing without Triton, under its interpreter
    or with a Triton that has no such hooks (before 3.4)."""
    count = CompileCount()
    if not _hooks_installed():
        yield count
        return
    _ACTIVE.append(count)
    try:
        yield count
    finally:
        _ACTIVE.remove(count)
