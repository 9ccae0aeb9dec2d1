"""Where a decode step's time goes: torch.profiler over steady-state decode steps.

  python bench/profile_step.py --model llama-3.1-8b --load-format dummy --batch 64 --input-len 512
  python bench/profile_step.py --smoke   # a tiny random model on the CPU: the code only
Prints (and saves) the top kernels by GPU time, wall time per step (with and without async
scheduling) and the fraction of it the GPU was busy (with async scheduling, as the engine runs
by default). With `--mixed N`, N more prompts of input-len tokens then arrive beside the
decoding batch, and the mixed steps that prefill them (a prompt chunk of up to
max_num_batched_tokens beside the decodes, as most steps of a 1000 x 1000 offline run's first
half) are profiled the same way ("mixed" in the JSON).

  python bench/profile_step.py --batch 800 --input-len 1000 --max-num-seqs 1024 --mixed 8 \
      --quantization fp8 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from skyline.bench.offline import random_prompts, save_json
from skyline.bench.smoke import tiny_model
from skyline.engine.frontend.llm import LLM
from skyline.engine.step_trace import timed
from skyline.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--mixed", type=int, default=0,
                    help="then profile the mixed steps of this many new prompts' prefill")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, 4 requests, on the CPU (no kernel table)")
    a = ap.parse_args()
    extra: dict[str, Any] = {} if a.max_num_seqs is None else {"max_num_seqs": a.max_num_seqs}
    if a.smoke:
        a.model, a.batch, a.input_len, a.steps = tiny_model(), 4, 16, 3
        a.mixed = 2  # the mixed-step profile too: the code only
        extra |= {"device": "cpu", "kv_cache_memory": "64MiB"}
    gpu = torch.cuda.is_available() and not a.smoke
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    llm = LLM(a.model, load_format=a.load_format, max_model_len=a.input_len + 256,
              quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, **extra)
    prompts = random_prompts(a.batch, a.input_len, llm.config.model.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    while llm.engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running
    ):
        llm.step()
    for _ in range(3):
        llm.step()
    sync()
    e = llm.engine

    def wall_per_step() -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            llm.step(final_only=True)
        sync()
        return (time.perf_counter() - t0) / a.steps

    # Host phases of a synchronous step (schedule, launch + wait, update: the rest of the
    # step), then the wall time per step with and without async scheduling (host work hidden
    # behind the device's).
    e.async_scheduling = False
    llm.step()  # collects the step in flight
    phases = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
    schedule, update = e.scheduler.schedule, e.scheduler.update
    e.scheduler.schedule = timed(phases, "schedule", schedule)
    e.scheduler.update = timed(phases, "update", update)
    t1 = time.perf_counter()
    for _ in range(a.steps):
        e.step()
    phases["execute"] = time.perf_counter() - t1 - phases["schedule"] - phases["update"]
    e.scheduler.schedule, e.scheduler.update = schedule, update
    wall_sync = wall_per_step()
    e.async_scheduling = True
    wall = wall_per_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(a.steps):
            llm.step(final_only=True)
        sync()
    gpu_ms, top = device_kernels(prof, a.steps)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18))
    res = {"batch": a.batch, "input_len": a.input_len, "quantization": a.quantization,
           "kv_cache_dtype": a.kv_cache_dtype,
           # With programmatic dependent launch a kernel's time includes its wait for the
           # previous one: the kernel table then overlaps and does not add up to the step.
           "pdl": llm.query("describe")["pdl"],
           "wall_ms_per_step": wall * 1e3,
           "wall_ms_per_step_sync": wall_sync * 1e3,
           "gpu_busy_ms_per_step": gpu_ms, "gpu_busy_fraction": gpu_ms / (wall * 1e3),
           "phases_ms_per_step": {k: v / a.steps * 1e3 for k, v in phases.items()},
           "kernels": top}
    if a.mixed:
        res["mixed"] = profile_mixed(llm, a.mixed, a.input_len, sync, gpu)
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


def device_kernels(prof: Any, steps: int) -> tuple[float, list[dict[str, Any]]]:
    """(device-busy ms per step, the top kernels per step) of a profiled window. Device-side
    events only (kernels, copies, memsets): an aten op's own "device time" is that of the
    kernels it launched, which the kernel rows already count."""
    events = [ev for ev in prof.key_averages()
              if ev.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(ev.self_device_time_total for ev in events) / steps
    top = [{"name": ev.key[:120], "us_per_step": ev.self_device_time_total / steps,
            "calls_per_step": ev.count / steps}
           for ev in sorted(events, key=lambda ev: -ev.self_device_time_total)
           if ev.self_device_time_total > 0][:25]
    return busy_us / 1e3, top


def profile_mixed(llm: LLM, n: int, input_len: int, sync: Any, gpu: bool) -> dict[str, Any]:
    """The steps that prefill `n` new prompts beside the running batch: their count, prompt
    tokens each, wall time (synchronized per step) and kernels."""
    sched = llm.engine.scheduler
    prompts = random_prompts(n, input_len, llm.config.model.arch.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    ids = {llm.add_request(p, params) for p in prompts}
    llm.engine.async_scheduling = False
    prefilled, walls = [], []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])

    def computed() -> int:  # the new prompts' tokens in the cache
        return sum(r.num_computed_tokens for r in sched.running if r.request_id in ids)

    sync()
    with profile(activities=activities) as prof:
        while computed() < n * input_len:
            before = computed()
            t = time.perf_counter()
            llm.engine.step()
            sync()
            walls.append(time.perf_counter() - t)
            prefilled.append(computed() - before)
    steps = len(walls)
    busy_ms, top = device_kernels(prof, steps)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18))
    return {"prompts": n, "steps": steps, "prefill_tokens_per_step": prefilled,
            "decodes": len(sched.running) - n, "wall_ms_per_step": 1e3 * sum(walls) / steps,
            "gpu_busy_ms_per_step": busy_ms, "kernels": top}


if __name__ == "__main__":
    main()
