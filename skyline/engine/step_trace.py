"""Where a run's time goes: every engine step's shape and seconds, and a summary (an offline
run's, bench/offline.py; a served engine's with SKYLINE_STEP_TRACE, engine/process.py).

A step is a *decode step* when each of its requests is scheduled one token (its last sampled
token); otherwise it carries prefill (a prompt chunk, or a preempted request's recompute) and
is a *mixed step*. The context of a step is the number of KV positions its attention reads:
for each request, the tokens cached before the step plus those it schedules. The wait of a
step is how long the host blocked on the device for sampled tokens meanwhile: near zero when
the host's own work (scheduling, input building, an eager forward) sets the pace. A step that
compiled Triton kernels (a shape no warm-up or CUDA graph capture reached) shows with them:
the summary names them, and the slowest steps.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from skyline.types import SchedulerOutput


def timed(phases: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding the seconds of each call to phases[name] (a phase of the engine's host
    work, when it stands in for an engine method: bench/host_overhead.py)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - t
    return wrapper


# Decode steps are grouped by batch size into these buckets (upper bounds, inclusive).
BATCH_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 768, 1024, 1 << 30)


def no_clocks() -> dict[str, Any]:
    return {"wait_s": 0.0, "compiles": 0, "compile_s": 0.0, "kernels": {}}


# The slowest steps the summary lists.
NUM_SLOWEST = 8


class StepTrace:
    """Collects (decode rows, prefill tokens, context tokens, seconds, wait seconds,
    compilations, compile seconds) per step of an engine it observes (engine/core.py,
    `StepObserver`) between `reset` and `stop`. `clock` returns the runner's running totals
    (worker/queries.py `step_clocks`): the host's seconds of waiting for the device, and the
    Triton compilations since start-up with their seconds and kernels."""

    def __init__(self, clock: Callable[[], dict[str, Any]] = no_clocks) -> None:
        self.clock = clock
        self.rows: list[tuple[int, int, int, float, float, int, float]] = []
        self.recording = False
        self._first = self._last = no_clocks()

    def reset(self) -> None:
        """Forget the steps seen so far (a warm-up's) and record from now on."""
        self.rows = []
        self._first = self._last = self.clock()
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    def __call__(self, out: SchedulerOutput, scheduled_at: float, seconds: float) -> None:
        if not self.recording:
            return
        computed = {r.request_id: r.num_computed_tokens for r in out.new_requests}
        computed.update((r.request_id, r.num_computed_tokens) for r in out.cached_requests)
        decode = prefill = context = 0
        for rid, n in out.num_scheduled_tokens.items():
            context += computed.get(rid, 0) + n
            if n == 1:
                decode += 1
            else:
                prefill += n
        last, self._last = self._last, self.clock()
        self.rows.append((decode, prefill, context, seconds, self._last["wait_s"] - last["wait_s"],
                          self._last["compiles"] - last["compiles"],
                          self._last["compile_s"] - last["compile_s"]))

    def write(self, path: str) -> None:
        """The summary to `path` as JSON (a served engine's, SKYLINE_STEP_TRACE); a path that
        cannot be written is logged, not raised: the engine is stopping."""
        try:
            with open(path, "w") as f:
                json.dump(self.summary(), f, indent=1)
        except OSError as e:
            logging.getLogger(__name__).warning("the step trace could not be written to %s: %s",
                                                path, e)

    def summary(self) -> dict[str, Any]:
        """Seconds in mixed and decode steps, and decode steps by batch size (seconds, steps,
        mean step ms, mean context per sequence, output tok/s within those steps, and the
        share of their seconds the host spent waiting for the device)."""
        mixed = [r for r in self.rows if r[1]]
        dec = [r for r in self.rows if not r[1]]
        total = sum(r[3] for r in self.rows) or 1.0
        by_batch: list[dict[str, Any]] = []
        lo = 0
        for hi in BATCH_BUCKETS:
            rows = [r for r in dec if lo < r[0] <= hi]
            if rows:
                s = sum(r[3] for r in rows)
                n = sum(r[0] for r in rows)
                by_batch.append({
                    "batch": f"{lo + 1}-{hi}" if hi < 1 << 30 else f">{lo}",
                    "steps": len(rows), "seconds": s, "share": s / total,
                    "mean_batch": n / len(rows), "mean_step_ms": 1e3 * s / len(rows),
                    "mean_context": sum(r[2] for r in rows) / n, "tok_s": n / s,
                    "wait_share": sum(r[4] for r in rows) / s,
                })
            lo = hi
        ms = sum(r[3] for r in mixed)
        first, last = self._first["kernels"], self._last["kernels"]
        compiled = {k: n - first.get(k, 0) for k, n in last.items() if n > first.get(k, 0)}
        slowest = sorted(self.rows, key=lambda r: -r[3])[:NUM_SLOWEST]
        return {
            "steps": len(self.rows),
            "seconds": total,
            "mixed_steps": len(mixed),
            "mixed_seconds": ms,
            "mixed_share": ms / total,
            "mixed_wait_share": sum(r[4] for r in mixed) / (ms or 1.0),
            "mixed_prefill_tokens": sum(r[1] for r in mixed),
            "mixed_decode_tokens": sum(r[0] for r in mixed),
            "decode_steps": len(dec),
            "decode_seconds": total - ms,
            "decode_tokens": sum(r[0] for r in dec),
            "decode_by_batch": by_batch,
            "compiles": sum(r[5] for r in self.rows),
            "compile_seconds": sum(r[6] for r in self.rows),
            "compiled_kernels": compiled,
            "slowest_steps": [{"decode": r[0], "prefill": r[1], "context": r[2],
                               "ms": 1e3 * r[3], "wait_ms": 1e3 * r[4], "compiles": r[5],
                               "compile_ms": 1e3 * r[6]} for r in slowest],
        }
