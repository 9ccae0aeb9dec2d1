"""The CPU's tuner: what the CPU plan (ops/cpu_plan.py) guesses from the CPU's flags, measured on
this machine with the model's own Linear shapes: up to how many rows the plan's kernel of 4-bit
codes (torch's int4 kernel, or the integer dot kernel) beats the dense product (`int4_rows`),
the same for the integer dot kernel's 8-bit codes (`intdot_rows`) and the bf16 kernel's bfloat16
weights (`bf16_rows`), and the thread count of the decode step's products. No new numerics: the
same kernels the plan already chooses between, the same dtypes and rounding.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from skyline.ops import cpu_bf16, cpu_int4, cpu_intdot, cpu_linear, cpu_plan, host_memory
from skyline.tune.workload import model_linears

ROWS = (1, 2, 4, 8, 16, 32)
GROUP = 32  # a GGUF Q4 block


def _seconds(fn: Callable[[], Any], min_s: float) -> float:
    """Median seconds of `fn` over runs adding up to about `min_s` (at least 3), after one."""
    fn()
    t = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t, 1e-7)
    reps = max(3, min(200, int(min_s / once)))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _copies(shapes: list[tuple[int, int]], bytes_per_weight: float) -> int:
    # enough copies of the layer that the weights stream from memory (64 MiB, past any L3
    # share a decode step's working set has), as in a step of a many-layer model
    layer = sum(n * k for n, k in shapes) * bytes_per_weight
    return max(1, min(32, int((64 << 20) // max(layer, 1))))


def dense_pass(shapes: list[tuple[int, int]], dtype: torch.dtype, copies: int
               ) -> Callable[[int], Callable]:
    """rows -> a pass over `copies` copies of the layer's dense products (oneDNN-packed where
    it can)."""
    ws = []
    for _ in range(copies):
        for n, k in shapes:
            w = (torch.randn(n, k) * 0.02).to(dtype)
            ws.append(cpu_linear.pack(w) if cpu_linear.can_pack(w) else w)

    def at(rows: int) -> Callable:
        xs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}

        def run() -> None:
            for w in ws:
                x = xs[w.shape[1]]
                if w.is_mkldnn:
                    cpu_linear.packed_linear(x, w)
                else:
                    torch.nn.functional.linear(x, w)
        return run
    return at


def _random_packed(shapes: list[tuple[int, int]], copies: int, bits: int,
                   pack: Callable[[torch.Tensor, torch.Tensor], Any], what: str
                   ) -> list[tuple[Any, int]]:
    """(weight, K) for `copies` copies of the layer's products: random `bits`-bit codes with a
    scale per GROUP, packed by `pack(codes, scale)` (None: ValueError naming `what`)."""
    ws = []
    for _ in range(copies):
        for n, k in shapes:
            codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
            codes[0, 0] = (1 << bits) - 1  # the widest code, so that a packer keeps `bits`
            w = pack(codes, torch.rand(n, k // GROUP) * 1e-2 + 1e-3)
            if w is None:
                raise ValueError(f"the {what} cannot take a {n}x{k} weight")
            ws.append((w, k))
    return ws


def int4_pass(shapes: list[tuple[int, int]], dtype: torch.dtype, copies: int
              ) -> Callable[[int], Callable]:
    """rows -> a pass over `copies` copies of the layer's products on the int4 kernel (one
    plane: 4-bit codes)."""
    ws = _random_packed(shapes, copies, 4, lambda c, s: cpu_int4.pack_planes(
        c, s, torch.zeros_like(s), GROUP, False), "int4 kernel")

    def at(rows: int) -> Callable:
        xs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}
        return lambda: [cpu_int4.planes_linear(xs[k], p) for p, k in ws]
    return at


def intdot_pass(shapes: list[tuple[int, int]], dtype: torch.dtype, copies: int, bits: int,
                rounds: int) -> Callable[[int], Callable]:
    """rows -> a pass over `copies` copies of the layer's products on the integer dot kernel
    (`bits`-bit codes, activations rounded `rounds` times)."""
    ws = _random_packed(shapes, copies, bits, lambda c, s: cpu_intdot.pack(
        c, s, -8 * s, GROUP, rounds), "integer dot kernel")

    def at(rows: int) -> Callable:
        xs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}
        return lambda: [cpu_intdot.intdot_mm(xs[k], w) for w, k in ws]
    return at


def bf16_pass(shapes: list[tuple[int, int]], copies: int) -> Callable[[int], Callable]:
    """rows -> a pass over `copies` copies of the layer's products on the bf16 kernel, its
    weights in huge pages as the engine holds them (ops/host_memory.py)."""
    holder = SimpleNamespace(ws=tuple((torch.randn(n, k) * 0.02).to(torch.bfloat16)
                                      for _ in range(copies) for n, k in shapes))
    host_memory.into_huge_pages([(holder, "ws")])

    def at(rows: int) -> Callable:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for _, k in shapes}
        return lambda: [cpu_bf16.bf16_mm(xs[w.shape[1]], w) for w in holder.ws]
    return at


def _crossover(name: str, kernel: Callable[[int], Callable], dense: Callable[[int], Callable],
               rows: list[int], min_s: float, log: Callable[[str], None]) -> int:
    """The most rows up to which `kernel` is not slower than `dense` (stopping at the first
    count where it is)."""
    wins = 0
    for r in rows:
        t_k, t_dense = _seconds(kernel(r), min_s), _seconds(dense(r), min_s)
        log(f"  rows {r}: {name} {t_k * 1e3:.2f} ms, dense {t_dense * 1e3:.2f} ms")
        if t_k > t_dense:
            break
        wins = r
    return wins


def tune_cpu(arch: Any, batch: int, budget_s: float, smoke: bool = False,
             threads: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The CPU plan's entry for this machine: {"int4_rows", "intdot_rows", "bf16_rows",
    "threads"} measured now (the rows where the plan runs that kernel), for the plan's family
    (the key of the table); `threads` given (--threads): that count, not tuned."""
    plan = cpu_plan.plan()
    shapes = model_linears(arch)
    min_s = 0.005 if smoke else max(0.02, min(0.2, budget_s / 60))
    rows = [r for r in ROWS if r <= (4 if smoke else 32)]
    out: dict[str, Any] = {}
    # threads first: the product of a decode step (batch 1 and the batch), dense as the plan
    # runs it above int4_rows, at each candidate count
    cores = os.cpu_count() or 1
    current = torch.get_num_threads()
    counts = [threads] if threads else sorted({1, max(1, cores // 2), cores, current})
    # the same layers for every kernel, enough that the narrowest (4-bit codes, about half a
    # byte a weight) still streams from memory rather than the last-level cache
    copies = _copies(shapes, 0.5 if plan.gguf_packed else plan.dtype.itemsize)
    dense = dense_pass(shapes, plan.dtype, copies)
    runs = [dense(1), dense(min(batch, 64))]
    by_threads = {}
    try:
        for t in counts:
            torch.set_num_threads(t)
            by_threads[t] = sum(_seconds(run, min_s) for run in runs)
    finally:
        torch.set_num_threads(current)
    if not threads:  # --threads wins over the plan's count: nothing to store
        out["threads"] = min(by_threads, key=by_threads.__getitem__)
    log("  threads: " + ", ".join(f"{t}: {s * 1e3:.2f} ms" for t, s in by_threads.items()))
    on_intdot = plan.int4_kernel == "intdot"
    kernels = []  # (field, name, the kernel's pass) the plan runs
    if plan.int4_rows > 0 and (on_intdot or cpu_int4.has_kernel()):
        kernels.append(("int4_rows", "4-bit codes, " + plan.int4_kernel, lambda: (
            intdot_pass(shapes, plan.dtype, copies, 4, plan.intdot_rounds) if on_intdot
            else int4_pass(shapes, plan.dtype, copies))))
    if plan.intdot_rows > 0:
        kernels.append(("intdot_rows", "8-bit codes, intdot",
                        lambda: intdot_pass(shapes, plan.dtype, copies, 8, plan.intdot_rounds)))
    if plan.bf16_rows > 0:
        kernels.append(("bf16_rows", "bf16 kernel", lambda: bf16_pass(shapes, copies)))
    torch.set_num_threads(min(by_threads, key=by_threads.__getitem__))
    try:
        for field, name, make in kernels:
            try:
                out[field] = _crossover(name, make(), dense, rows, min_s, log)
            except ValueError as e:  # shapes the kernel cannot take: keep the plan's rows
                log(f"  {name} not measured: {e}")
                out[field] = getattr(plan, field)
    finally:
        torch.set_num_threads(current)
    return {cpu_plan.KERNEL: {plan.family: out}}
