"""Where a step waits for the device, by sampling parameters (CUDA).

With async scheduling the host builds step N+1 while the device runs step N, and waits only to
read step N's tokens. An operation inside a step that waits for the device (a `.item()`, a
copy to pageable memory, a boolean mask's `nonzero`) serialises the two: the step then takes
the host's time plus the device's, and the trace shows the host never waiting for tokens
(it already did). This runs one engine in this process on N prompts for each set of
sampling parameters (as served clients send them), with PyTorch's sync debug mode on for the
timed run, and reports for each set the decode steps' ms, the host's share of waiting for
tokens, and every synchronising call by its source line.

    python bench/host_syncs.py --model llama-3.1-8b --num-prompts 256 \\
        --out bench/results/host/host-syncs-h200-llama-3.1-8b.json
    python bench/host_syncs.py --num-prompts 16 --input-len 64 --output-len 64 --text \
        --sets greedy top_p top_p_top_k   # the default model on the CPU: the sampling's cost
    python bench/host_syncs.py --smoke   # the tiny model; on the CPU nothing synchronises
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import os
import pstats
import subprocess
import sys
import time
import warnings
from collections import Counter
from typing import Any

import torch

from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.engine.frontend.llm import LLM
from skyline.engine.step_trace import StepTrace
from skyline.ops.triton_utils import compiled_specs
from skyline.types import SamplingParams

# name -> sampling parameters besides max_tokens and ignore_eos
PARAM_SETS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "min_tokens": {"temperature": 0.0, "min_tokens": -1},  # -1: max_tokens (served clients')
    "penalties": {"temperature": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                  "frequency_penalty": 0.5},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "top_p_top_k": {"temperature": 0.8, "top_p": 0.9, "top_k": 50},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "seeded": {"temperature": 1.0, "seed": 7},
    "logprobs": {"temperature": 0.0, "logprobs": 5},
    "logit_bias": {"temperature": 0.0, "logit_bias": {100: 2.0, 200: -2.0}},
    "mixed": {},  # requests that differ: MIXED in turn
}
MIXED = ("greedy", "top_p", "top_p_top_k", "seeded")


def _params(name: str, output_len: int) -> tuple[list[SamplingParams], Any]:
    """The set's parameters, one per prompt in turn, and what the JSON records of them."""
    if name == "mixed":
        return [_params(m, output_len)[0][0] for m in MIXED], list(MIXED)
    extra = dict(PARAM_SETS[name])
    if extra.get("min_tokens") == -1:
        extra["min_tokens"] = output_len
    return [SamplingParams(max_tokens=output_len, ignore_eos=True, **extra)], extra


def _where(w: warnings.WarningMessage) -> str:
    return f"{w.filename.rsplit('skyline/', 1)[-1]}:{w.lineno}"


TEXT = ("The river rose through the night, and by morning the old bridge stood alone in the "
        "water. People came down from the hills to look at it, and the children asked why it had "
        "not fallen. The engineer who built it had died long ago, but her notes were kept in the "
        "library, and they explained how each stone was cut to lean on the next. ")


def text_prompts(llm: LLM, num: int, length: int) -> list[list[int]]:
    """`num` prompts of `length` tokens of English text, each starting at its own word."""
    if llm.tokenizer is None:
        raise SystemExit("--text needs a model with a tokenizer")
    ids = llm.tokenizer.encode(TEXT * (1 + length // 40), add_special_tokens=False)
    ids = ids * (1 + (length + num) // len(ids))
    return [ids[i : i + length] for i in range(num)]


def engine_revision() -> str:
    """The commit of the checkout `skyline` is imported from (+ "-dirty")."""
    import skyline

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(skyline.__file__))
                              ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def why_compiled(spec: dict[str, str], earlier: list[dict[str, str]]) -> str:
    """Where a compilation's specialization (ops/triton_utils.compiled_specs) differs from the
    closest earlier one of the same kernel."""
    if not earlier:
        return "first of its kernel"

    def diff(old: dict[str, str]) -> list[str]:
        return [f"{k} {old.get(k)} -> {v}" for k, v in spec.items() if old.get(k) != v]

    return "; ".join(min((diff(o) for o in earlier), key=len)) or "the same specialization"


def top_functions(prof: cProfile.Profile, n: int = 12) -> list[dict[str, Any]]:
    """The host's n costliest functions of a profile, by their own seconds."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [{"function": f"{f.rsplit('skyline/', 1)[-1]}:{line}({fn})", "calls": nc,
             "own_s": tt, "total_s": ct} for (f, line, fn), (_, nc, tt, ct, _) in rows]


def run_set(llm: LLM, trace: StepTrace, name: str, prompts: list[list[int]],
            output_len: int, profile: bool = False) -> dict[str, Any]:
    kinds, extra = _params(name, output_len)
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    warm = [dataclasses.replace(p, max_tokens=4, min_tokens=min(p.min_tokens, 4))
            for p in params[:len(kinds) + 1]]
    llm.generate(prompts[:len(warm)], warm)  # this set's warm-up
    cuda = llm.config.device.startswith("cuda")
    trace.reset()
    specs_before = len(compiled_specs())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        try:
            if prof is not None:
                prof.enable()
            llm.generate(prompts, params)
        finally:
            if prof is not None:
                prof.disable()
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        dt = time.perf_counter() - t0
    trace.stop()
    syncs = Counter(_where(w) for w in seen if "synchroniz" in str(w.message))
    specs = compiled_specs()
    compiled = [{"kernel": k, "why": why_compiled(spec, [o for n, o in specs[:i] if n == k])}
                for i, (k, spec) in enumerate(specs) if i >= specs_before]
    st = trace.summary()
    big = max(st["decode_by_batch"], key=lambda b: b["steps"], default=None)
    row = {"params": name, "sampling": extra, "elapsed_s": dt,
           "output_tok_s": len(prompts) * output_len / dt, "syncs": dict(syncs),
           "decode_steps": st["decode_steps"],
           "decode_step_ms": big["mean_step_ms"] if big else None,
           "decode_batch": big["mean_batch"] if big else None,
           "wait_share": big["wait_share"] if big else None, "compiled": compiled}
    if prof is not None:
        row["host_profile"] = top_functions(prof)
    print(f"{name:>12}: {row['output_tok_s']:9.1f} tok/s, decode "
          f"{row['decode_step_ms'] or 0:6.2f} ms/step at {row['decode_batch'] or 0:.0f} seqs, "
          f"host waits {row['wait_share'] or 0:.2f}; {sum(syncs.values())} synchronising calls"
          + "".join(f"\n{'':>14}{n:6d} x {where}" for where, n in syncs.most_common(8))
          + "".join(f"\n{'':>14}compiled {c['kernel']}: {c['why']}" for c in compiled)
          + "".join(f"\n{'':>14}{f['own_s']:7.3f} s own, {f['calls']:7d} calls: {f['function']}"
                    for f in row.get("host_profile", [])))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="shipped config name (dummy weights)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sets", nargs="+", default=list(PARAM_SETS), choices=list(PARAM_SETS))
    ap.add_argument("--profile", nargs="*", default=[], choices=list(PARAM_SETS),
                    help="sets whose timed run the host's profiler watches (cProfile)")
    ap.add_argument("--text", action="store_true",
                    help="prompts of English text (a model's distributions after text are "
                         "peaked, after random tokens flat: what top-p keeps differs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="the default model, 8 short prompts")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.num_prompts, a.input_len, a.output_len = None, 8, 16, 8
        a.profile = a.profile or ["penalties"]
        # a set per path of the sampler's step: greedy, penalties, and mixed (nucleus, top-k,
        # seeded rows side by side); the others are the same paths with other parameters
        a.sets = [s for s in a.sets if s in ("greedy", "penalties", "mixed")] or a.sets
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine: dict[str, Any] = {"device": device}
    if a.model:
        engine |= {"model": a.model, "load_format": "dummy"}
    if device == "cpu":
        print("no CUDA device: nothing can synchronise; the sets run for their speed only",
              file=sys.stderr)
    trace = StepTrace()
    llm = LLM(**engine, max_num_seqs=max(a.num_prompts, 1), observers=[trace])
    try:
        trace.clock = lambda: llm.query("step_clocks")
        prompts = (text_prompts(llm, a.num_prompts, a.input_len) if a.text else
                   random_prompts(a.num_prompts, a.input_len, llm.config.model.arch.vocab_size))
        rows = [run_set(llm, trace, name, prompts, a.output_len, name in a.profile)
                for name in a.sets]
    finally:
        llm.shutdown()
    save_json({
        "benchmark": "host_syncs",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "model": llm.config.model.name, "device": device, "num_prompts": a.num_prompts,
        "input_len": a.input_len, "output_len": a.output_len,
        "engine_revision": engine_revision(), "machine": machine_info(device), "rows": rows,
    }, a.out)


if __name__ == "__main__":
    main()
