"""The workload a tune round measures, run through the engine's public API: one long prompt's
prefill, batch-1 decode, and a batch of sequences decoding at a context. Each phase is timed by
the wall clock (the end-to-end figure a round keeps or reverts on) and, on request, profiled
with torch.profiler (device kernels on a GPU, CPU ops on a CPU), in the engine's process.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from skyline.config import ModelArch
from skyline.engine.frontend.llm import LLM
from skyline.tune.rank import PhaseWork, phase_work
from skyline.types import SamplingParams

PHASES = ("prefill", "decode_1", "decode_batch")


def model_linears(arch: ModelArch) -> list[tuple[int, int]]:
    """[(N, K)] of one decoder layer's dense products (ModelArch.layer_linears): the shapes
    the kernel tuners measure."""
    return list(arch.layer_linears().values())


@dataclass(frozen=True)
class Workload:
    """What one measurement runs (flags of `skyline tune`)."""

    prefill_len: int  # tokens of the prompt whose prefill is timed
    batch: int  # sequences decoding at once in decode_batch
    context: int  # their prompt length (the context they decode at)
    decode_steps: int  # decode steps timed in each decode phase
    reps: int  # each phase's time is the median of this many runs

    @property
    def max_model_len(self) -> int:
        return max(self.prefill_len, self.context) + self.decode_steps + 16

    def work(self, cost: Any) -> dict[str, PhaseWork]:
        """The bytes and FLOPs of each phase (for the families' floors)."""
        return {"prefill": phase_work(cost, 1, self.prefill_len, 0, 1),
                "decode_1": phase_work(cost, 1, 1, 16, self.decode_steps),
                "decode_batch": phase_work(cost, self.batch, 1, self.context,
                                           self.decode_steps)}


@dataclass
class Measurement:
    """Seconds per phase (median of the reps), and each profiled phase's kernels."""

    phase_s: dict[str, float]
    kernels: dict[str, list[dict[str, Any]]]  # phase -> [{"name", "s"}], device time

    @property
    def total_s(self) -> float:
        return sum(self.phase_s.values())


def measure(llm: LLM, wl: Workload, profile: bool, seed: int = 0) -> Measurement:
    """Time (and with `profile`, profile) each phase of `wl` on `llm`, after a warm-up run.
    Prompts are new random tokens each run, so no run reuses another's cached prefix."""
    rng = random.Random(seed)
    vocab = llm.config.model.arch.vocab_size
    gpu = llm.config.device.startswith("cuda")
    sync: Callable[[], None] = torch.cuda.synchronize if gpu else (lambda: None)

    def prompt(n: int) -> list[int]:
        lo = min(1000, vocab // 4)
        return [rng.randrange(lo, vocab) for _ in range(n)]

    # each run times (and a profiled run profiles) only its window: a decode phase's prefill
    # steps stay outside it
    runs: dict[str, Callable[[Window], float]] = {
        "prefill": lambda w: _prefill(llm, prompt(wl.prefill_len), sync, w),
        "decode_1": lambda w: _decode(llm, [prompt(16)], wl.decode_steps, sync, w),
        "decode_batch": lambda w: _decode(llm, [prompt(wl.context) for _ in range(wl.batch)],
                                          wl.decode_steps, sync, w),
    }
    phase_s, kernels = {}, {}
    for name, run in runs.items():
        run(contextlib.nullcontext)  # warm-up (first calls compile, pack and capture)
        phase_s[name] = statistics.median(run(contextlib.nullcontext) for _ in range(wl.reps))
        if profile:
            prof = _profiler(gpu)
            run(lambda p=prof: p)
            kernels[name] = _kernels(prof, gpu)
    return Measurement(phase_s, kernels)


Window = Callable[[], contextlib.AbstractContextManager[Any]]


def _prefill(llm: LLM, prompt: list[int], sync: Callable[[], None], window: Window) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync()
    with window():
        t = time.perf_counter()
        llm.generate([prompt], params)
        sync()
        return time.perf_counter() - t


def _decode(llm: LLM, prompts: list[list[int]], steps: int, sync: Callable[[], None],
            window: Window) -> float:
    """Seconds of `steps` decode steps of all `prompts` at once, their prefill not counted."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    sched = llm.engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):
        llm.step(final_only=True)
    sync()
    with window():
        t = time.perf_counter()
        for _ in range(steps):
            llm.step(final_only=True)
        sync()
        dt = time.perf_counter() - t
    for rid in ids:
        llm.abort(rid)
    while sched.num_waiting or sched.running:
        llm.step(final_only=True)
    return dt


def _profiler(gpu: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else []))


def _kernels(prof: Any, gpu: bool) -> list[dict[str, Any]]:
    """[{"name", "s"}] of a profiled window: device kernels' time on a GPU, ops' own CPU time
    on a CPU."""
    out = []
    for ev in prof.key_averages():
        if gpu:
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            s = ev.self_device_time_total / 1e6
        else:
            s = ev.self_cpu_time_total / 1e6
        if s > 0:
            out.append({"name": ev.key[:200], "s": s})
    return sorted(out, key=lambda k: -k["s"])
