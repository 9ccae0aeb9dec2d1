"""Decode speed on the CPU (one stream, or --streams at once) with OpenMP's default wait policy,
OMP_WAIT_POLICY=PASSIVE and PASSIVE with a short spin (GOMP_SPINCOUNT), on an idle machine and
on one where a busy process competes for a core.

OpenMP worker threads spin after each parallel region by default; when another process needs a
core, the spinning threads and the thread doing the work take turns on it, and a decode step of
hundreds of small parallel regions slows many times over. PASSIVE makes idle workers sleep at
once, and waking them costs every region some microseconds; a short spin first keeps them
awake between the regions of one step and lets them sleep between steps. The skyline command
sets PASSIVE with GOMP_SPINCOUNT=2000 unless the environment says otherwise
(skyline/cli/__init__.py); this script measures the choices. Each measurement is a fresh
process (the policy is read when OpenMP loads).

    python bench/omp_wait_policy.py --threads 2 --streams 1 16 \
        --policies default,PASSIVE,PASSIVE+spin=10000,PASSIVE+spin=100000 \
        --out bench/results/cpu/omp-wait-policy-cpu-smollm2.json
    python bench/omp_wait_policy.py --smoke   # one measurement of a tiny random model
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

_CHILD = r"""
import os, sys, time
policy, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = sys.argv[4] or None  # None: the default model
streams = int(sys.argv[5])
load_format = "dummy" if model else "auto"
os.environ.pop("OMP_WAIT_POLICY", None)
os.environ.pop("GOMP_SPINCOUNT", None)
for part in policy.split("+"):
    if part.startswith("spin="):  # GNU OpenMP: spin this many iterations, then sleep
        os.environ["GOMP_SPINCOUNT"] = part[5:]
    elif part != "default":
        os.environ["OMP_WAIT_POLICY"] = part
import torch  # OpenMP reads the policy now, before skyline could set its default

from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams

llm = LLM(model, load_format=load_format, threads=threads, kv_cache_memory="64MiB",
          max_model_len=512)
prompt = "Write a short story about a lighthouse keeper."
llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
if streams == 1:
    times = []
    for out in llm.stream(prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                  ignore_eos=True)):
        times.append(time.perf_counter())
    decode = (len(times) - 1) / (times[-1] - times[0])  # tokens after the first, per second
else:  # generation of `streams` prompts at once less that of one token each: decode alone
    prompts = [f"{prompt} ({i})" for i in range(streams)]
    spans = []
    for n in (1, tokens + 1):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        spans.append(time.perf_counter() - t)
    decode = streams * tokens / (spans[1] - spans[0])
print(f"RESULT {decode:.3f}")
"""


def measure(policy: str, threads: int, tokens: int, model: str = "", streams: int = 1) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, policy, str(threads), str(tokens),
                          model, str(streams)], capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(line.split()[1])
    raise RuntimeError(f"the measurement failed: {out.stderr[-800:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per measurement")
    ap.add_argument("--repeats", type=int, default=2, help="measurements per cell")
    ap.add_argument("--streams", type=int, nargs="+", default=[1],
                    help="requests decoded at once (1: a streamed request)")
    ap.add_argument("--policies", default="default,PASSIVE,PASSIVE+spin=10000",
                    help="comma-separated: default | PASSIVE | ACTIVE | spin=N (GOMP_SPINCOUNT), "
                    "or a policy and a spin count joined by + (PASSIVE+spin=10000)")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    ap.add_argument("--smoke", action="store_true",
                    help="one measurement (default policy, idle) of a tiny random model")
    ns = ap.parse_args()
    from skyline.bench.offline import machine_info, save_json
    from skyline.bench.smoke import tiny_model

    model, loads = "", ("idle", "loaded")
    if ns.smoke:
        model, loads = tiny_model(), ("idle",)
        ns.policies, ns.repeats, ns.tokens, ns.out = "default,PASSIVE+spin=10", 1, 4, None
        ns.streams = [1, 2]

    cells: dict[str, dict[str, list[float]]] = {}
    loadavg: dict[str, list[float]] = {}
    for load in loads:
        busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if load == "loaded" else None
        try:
            for _ in range(ns.repeats):  # alternate the policies: drift hits all alike
                for streams in ns.streams:
                    for policy in ns.policies.split(","):
                        load_avg = os.getloadavg()[0]  # other users of the machine show here
                        tps = measure(policy, ns.threads, ns.tokens, model, streams)
                        cell = f"{load}, {streams} stream{'s' * (streams > 1)}"
                        cells.setdefault(cell, {}).setdefault(policy, []).append(tps)
                        loadavg.setdefault(load, []).append(load_avg)
                        print(f"{cell:>18} {policy:>20}: {tps:7.2f} tok/s (load average "
                              f"before: {load_avg:.1f})", flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    summary = {cell: {p: max(v) for p, v in d.items()} for cell, d in cells.items()}
    for d in summary.values():
        base = d.get("default")
        for p in list(d):
            if base and p != "default":
                d[f"{p} / default"] = round(d[p] / base, 3)
    print(json.dumps(summary, indent=1))
    save_json({
        "benchmark": "omp_wait_policy",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info("cpu"), "load_average_1min_before_each_run": loadavg,
        "model": "SmolLM2-135M-Instruct Q4_1 (embedded default)", "threads": ns.threads,
        "decode_tokens": ns.tokens, "streams": ns.streams,
        "metric": "decode tok/s, all streams together (best of repeats)",
        "idle_means": "no process started by this script beside the engine (others may run)",
        "loaded_means": "one `yes` process spinning beside the engine",
        "runs_tok_s": cells, "summary": summary,
    }, ns.out)


if __name__ == "__main__":
    main()
