"""Host work per decode step at large batches: the engine's own Python, without the model.

The offline benchmark at 1,000 concurrent requests is bounded by the host when the host's work
per step (scheduling, the step's inputs, reading the tokens, stop checks, outputs) takes longer
than the device's forward pass. This measures that work alone: the real engine (scheduler, KV
manager, runner bookkeeping, sampler, output processor) drives a tiny model whose forward pass
is replaced by zeros, on the CPU, with async scheduling on as on CUDA. Each phase is timed,
and so are the garbage collector's pauses, with CPython's default collection thresholds and
with the engine's (`fewer_collections`, as `LLM.generate` and the engine process run);
`--profile` adds a cProfile of the timed steps.

    python bench/host_overhead.py --batch 256 1024 --context 1500 --out bench/results/host/X.json
    python bench/host_overhead.py --batch 256 --min-tokens  # min_tokens as served clients send
    python bench/host_overhead.py --batch 256 --penalties   # repetition, presence, frequency
    python bench/host_overhead.py --smoke   # 16 requests, a few steps
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import gc
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

from skyline.bench.offline import machine_info, save_json
from skyline.engine.core import fewer_collections
from skyline.engine.frontend.llm import LLM
from skyline.engine.step_trace import timed
from skyline.types import SamplingParams

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 2048,
        "max_position_embeddings": 1 << 20, "torch_dtype": "float32", "eos_token_id": 2}


# The runner's phases (the host_seconds query) by the names of this script's JSON.
RUNNER_PHASES = {"runner_states": "states", "build_inputs": "inputs",
                 "runner_read_tokens": "read_tokens"}


class GcPauses:
    """Collections and their seconds, by generation, while installed."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._t


def measure(batch: int, context: int, steps: int, engine_gc: bool,
            profile: str | None, min_tokens: bool = False,
            penalties: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(TINY, f)
        # Early requests decode while later ones prefill: room for all those steps.
        budget = max(8192, context)
        max_len = context + batch * context // budget + steps + 64
        block_bytes = 2 * 16 * 16 * 4  # K and V, 16 tokens, one head of 16, fp32
        llm = LLM(d, load_format="dummy", device="cpu", dtype="float32",
                  max_num_seqs=batch, max_model_len=max_len, async_scheduling="on",
                  max_num_batched_tokens=budget,
                  kv_cache_memory=batch * (-(-max_len // 16) + 1) * block_bytes)
    llm.query("zero_forward")  # what remains of a step is the host's work
    engine = llm.engine
    # to max_len; with min_tokens, as a served benchmark's clients send with ignore_eos (the
    # sampler masks every request's stop tokens at every step)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True,
                            min_tokens=max_len if min_tokens else 0)
    if penalties:  # each applied to every row's prompt and outputs at every step
        params = dataclasses.replace(params, repetition_penalty=1.1, presence_penalty=0.5,
                                     frequency_penalty=0.5)
    for i in range(batch):
        llm.add_request([1000 + (i * 7 + j) % 1000 for j in range(context)], params)
    sched = engine.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        llm.step()  # prefill everyone
    for _ in range(4):
        llm.step()
    phases: dict[str, float] = defaultdict(float)
    sched.schedule = timed(phases, "schedule", sched.schedule)
    sched.update = timed(phases, "update", sched.update)
    llm.outputs.process = timed(phases, "outputs", llm.outputs.process)
    host_before = llm.query("host_seconds")  # the runner's own phases
    prof = cProfile.Profile() if profile else None
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    with fewer_collections() if engine_gc else contextlib.nullcontext():  # type: ignore[misc]
        for _ in range(steps):
            llm.step(final_only=True)
    if prof:
        prof.disable()
        prof.dump_stats(profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    wall = time.perf_counter() - t0
    gc.callbacks.remove(pauses)
    host = llm.query("host_seconds")
    for name, runner_phase in RUNNER_PHASES.items():
        phases[name] = host[runner_phase] - host_before[runner_phase]
    assert len(sched.running) == batch, "every request must decode through the timed steps"
    ms = {k: 1e3 * v / steps for k, v in sorted(phases.items())}
    return {"batch": batch, "context": context, "steps": steps, "min_tokens": min_tokens,
            "penalties": penalties,
            "gc": "engine" if engine_gc else "default",
            "step_ms": 1e3 * wall / steps, "us_per_request": 1e6 * wall / steps / batch,
            "phases_ms": ms, "gc_collections": pauses.count,
            "gc_ms_per_step": 1e3 * sum(pauses.seconds) / steps}


def engine_revision() -> str:
    """The commit of the engine measured, the checkout `skyline` is imported from (+ "-dirty"
    with uncommitted changes)."""
    import skyline

    here = os.path.dirname(os.path.abspath(skyline.__file__))
    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here,
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    return rev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", help="write a cProfile of the largest batch's steps here")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="16 requests of 64 tokens, 4 steps")
    ap.add_argument("--min-tokens", action="store_true",
                    help="requests also ask for min_tokens (a served benchmark's clients do)")
    ap.add_argument("--penalties", action="store_true",
                    help="requests also ask for repetition, presence and frequency penalties")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.context, args.steps, args.out = [16], 64, 4, None
    rows = []
    for b in args.batch:
        for engine_gc in (False, True):
            prof = args.profile if b == max(args.batch) and engine_gc else None
            row = measure(b, args.context, args.steps, engine_gc, prof, args.min_tokens,
                          args.penalties)
            rows.append(row)
            parts = ", ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items())
            print(f"batch {b:5d} context {args.context} gc {row['gc']:>7}: {row['step_ms']:6.2f} "
                  f"ms/step ({row['us_per_request']:.1f} us/request, gc pauses "
                  f"{row['gc_ms_per_step']:.2f} ms/step); {parts}")
    save_json({"benchmark": "host_overhead",
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "engine_revision": engine_revision(), "machine": machine_info("cpu"),
               "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
               "rows": rows}, args.out)


if __name__ == "__main__":
    main()
