"""Served against offline at the same concurrency: the same engine flags, the same N random
prompts of fixed lengths, C sequences at a time, first through `LLM.generate` (`skyline bench
offline`), then through `skyline serve` streaming to C users spread over several load-generator
processes (one Python client saturates near 9k tok/s), once per API server count
(`serve --api-server-count`, --api-servers 1 4: one offline run, then a served run with one API
process and one with four). The goal (issue 31): served output tokens/s >= 0.95 of offline,
TTFT p50 <= 150 ms and p99 <= 1 s.

A closed loop of requests that all ask for the same number of tokens runs in waves: the C users
start at once, their C prompts queue behind each other's prefill, they finish in the same few
steps and the next C arrive together. Each run's TTFT is also given for its first wave (the C
requests that started first) and for the rest. `--rates F ...` adds served runs (with the first
API server count) whose requests arrive as a Poisson process at F times the offline run's
request rate, at most C in flight: users who do not arrive in step.

The model directory is the shipped config with the synthetic word-level tokenizer
(skyline/bench/dummy_model.py), so that the server detokenizes and streams real text.

    python bench/served_vs_offline.py --model llama-3.1-8b --concurrency 256 --processes 8 \
        --api-servers 1 4
    python bench/served_vs_offline.py --smoke        # the tiny model on the CPU, 8 streams,
                                                     # 1 and 2 API processes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

from skyline.bench.dummy_model import tiny_model_dir, write_model_dir
from skyline.bench.frontier import start_server, stop_server
from skyline.bench.metrics import split_first, stats_ms, summarize
from skyline.bench.serve import LoadProcesses, LoadSpec, http_stack
from skyline.bench.workloads import WorkloadSpec


def offline(model: str, flags: list[str], ns: argparse.Namespace, work: str) -> dict:
    """`skyline bench offline` in its own process (the device's memory is free afterwards)."""
    path = os.path.join(work, "offline.json")
    cmd = [sys.executable, "-m", "skyline.cli", "bench", "offline", "--model", model,
           "--num-prompts", str(ns.num_requests), "--input-len", str(ns.input_len),
           "--output-len", str(ns.output_len), "--temperature", str(ns.temperature),
           "--top-p", str(ns.top_p), "--output", path, *flags]
    subprocess.run(cmd, check=True, timeout=ns.timeout)
    with open(path) as f:
        res = json.load(f)
    return {**res["skyline"], "steps": res.get("steps")}


def served(model: str, flags: list[str], ns: argparse.Namespace, work: str,
           api_servers: int, rate: float | None = None) -> dict:
    """One served run; `rate`: requests a second, Poisson (None: each user sends its next
    request when its last ends)."""
    tag = f"{api_servers}" + (f"-rate{rate:.2f}" if rate else "")
    log = os.path.join(work, f"server-{tag}.log")
    # the engine's steps (engine/step_trace.py), written when it stops: their shapes and
    # seconds beside the offline run's
    trace = os.path.join(work, f"steps-{tag}.json")
    os.environ["SKYLINE_STEP_TRACE"] = trace
    try:
        proc, url = start_server(["--model", model, "--api-server-count", str(api_servers),
                                  *flags], log, ns.timeout)
    finally:
        del os.environ["SKYLINE_STEP_TRACE"]
    try:
        # /health answers from the first API process up; the banner follows all of them
        deadline = time.monotonic() + ns.timeout
        while api_servers > 1 and time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                text = f.read()
            if "API processes: pids" in text:
                break
            if proc.poll() is not None:  # it stopped starting: say why, do not wait it out
                raise RuntimeError(f"skyline serve stopped during start-up: {text[-600:]}")
            time.sleep(0.2)
        load = LoadSpec(base_url=url, concurrency=ns.concurrency, num_requests=ns.num_requests,
                        timeout=ns.timeout, setup_timeout=ns.timeout,
                        temperature=ns.temperature, top_p=ns.top_p, request_rate=rate)
        work_spec = WorkloadSpec(name="random", input_len=str(ns.input_len),
                                 output_len=str(ns.output_len))
        results, seconds = LoadProcesses(load, work_spec, ns.processes).wait()
        by_process = requests_by_api_server(url)
    finally:
        stop_server(proc)
    steps = None
    if os.path.exists(trace):
        with open(trace) as f:
            steps = json.load(f)
    first, rest = split_first(results, ns.concurrency)
    return {**summarize(results, seconds), "requests_by_api_server": by_process, "steps": steps,
            "ttft_first_wave_ms": stats_ms([r.ttft for r in first if r.success]),
            "ttft_after_first_wave_ms": stats_ms([r.ttft for r in rest if r.success])}


def step_line(steps: dict | None) -> str:
    """A trace's steps in a few figures (engine/step_trace.py's summary)."""
    if not steps or not steps.get("steps"):
        return "no step trace"
    n, s = steps["steps"], steps["seconds"]
    tokens = steps["mixed_prefill_tokens"] + steps["mixed_decode_tokens"] + steps["decode_tokens"]
    return (f"{n} steps, {1e3 * s / n:.1f} ms and {tokens / n:.0f} tokens a step; mixed "
            f"{steps['mixed_steps']} ({100 * steps['mixed_share']:.0f}% of the time, host "
            f"waiting on the device {100 * steps['mixed_wait_share']:.0f}% of it); "
            f"{steps.get('compiles', 0)} Triton compilations "
            f"({steps.get('compile_seconds', 0.0):.1f} s), slowest step "
            f"{max((r['ms'] for r in steps.get('slowest_steps', [])), default=0.0):.0f} ms")


def requests_by_api_server(url: str) -> dict[str, float]:
    """How many requests each API process took (skyline:api_server_requests_total), so that an
    uneven spread over them shows; empty with one."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'skyline:api_server_requests_total\{api_server="(\d+)"[^}]*\} (\S+)', text)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="shipped config name (dummy weights)")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--processes", type=int, default=8, help="load-generator processes")
    ap.add_argument("--api-servers", type=int, nargs="+", default=[1],
                    help="API server counts to serve with, one served run each")
    ap.add_argument("--rates", type=float, nargs="*", default=[], metavar="F",
                    help="served runs with Poisson arrivals at F x offline's request rate")
    ap.add_argument("--flags", default="", help="more engine flags for both runs")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's nucleus")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per phase, at most")
    ap.add_argument("--out", default=None, help="JSON file (default: under bench/results/serve)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 8 streams")
    ns = ap.parse_args()
    if any(f <= 0 for f in ns.rates):
        ap.error("--rates takes fractions above 0 of the offline run's request rate")
    work = tempfile.mkdtemp(prefix="skyline-served-")
    flags = ["--load-format", "dummy", "--max-num-seqs", str(ns.concurrency),
             *shlex.split(ns.flags)]
    if ns.smoke:
        ns.concurrency, ns.num_requests, ns.input_len, ns.output_len = 8, 16, 16, 16
        ns.processes = 2
        ns.api_servers, ns.rates = [1, 2], [0.5]
        model = tiny_model_dir(work)
        flags = ["--load-format", "dummy", "--max-num-seqs", "8", "--device", "cpu",
                 "--threads", "1", "--max-model-len", "256", "--kv-cache-memory", "64MiB"]
    else:
        model = write_model_dir(ns.model, os.path.join(work, "model"))
    off = offline(model, flags, ns, work)
    offline_rps = off["output_tokens_per_s"] / ns.output_len
    plan = [(n, None) for n in ns.api_servers] + [(ns.api_servers[0], f) for f in ns.rates]
    runs = []
    for n, frac in plan:
        rate = None if frac is None else frac * offline_rps
        srv = served(model, flags, ns, work, n, rate)
        ratio = srv["output_throughput"] / off["output_tokens_per_s"]
        runs.append({
            "api_server_count": n, "request_rate": rate, "rate_of_offline": frac,
            "served_output_tok_s": srv["output_throughput"], "served_over_offline": ratio,
            "ttft_p50_ms": srv["ttft_ms"]["median"], "ttft_p99_ms": srv["ttft_ms"]["p99"],
            "failed": srv["failed"], "requests_by_api_server": srv["requests_by_api_server"],
            "served": srv,
        })
        how = (f"{ns.concurrency} users" if rate is None else
               f"{rate:.1f} requests/s ({frac:g} of offline's), at most {ns.concurrency} in flight")
        print(f"== served vs offline at {how}, {n} API process(es): offline "
              f"{off['output_tokens_per_s']:.0f} tok/s, served "
              f"{srv['output_throughput']:.0f} tok/s = {ratio:.3f} of offline; TTFT p50 "
              f"{runs[-1]['ttft_p50_ms']:.0f} ms, p99 {runs[-1]['ttft_p99_ms']:.0f} ms (first "
              f"wave p50 {srv['ttft_first_wave_ms']['median']:.0f} ms, the rest "
              f"{srv['ttft_after_first_wave_ms']['median']:.0f}); {srv['failed']} failed",
              flush=True)
        print(f"   steps offline: {step_line(off.get('steps'))}\n   steps served:  "
              f"{step_line(srv.get('steps'))}", flush=True)
    from skyline.bench.offline import machine_info  # (imports the engine: only once done)

    best = max((r for r in runs if r["request_rate"] is None),
               key=lambda r: r["served_over_offline"])
    out = {
        "benchmark": "served_vs_offline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "bench/served_vs_offline.py", *sys.argv[1:]]),
        # (CUDA first initialised here, once every server has stopped)
        "machine": machine_info("cpu" if ns.smoke else "cuda"),
        "model": "tiny" if ns.smoke else ns.model, "flags": flags,
        "concurrency": ns.concurrency, "num_requests": ns.num_requests,
        "input_len": ns.input_len, "output_len": ns.output_len,
        "sampling": {"temperature": ns.temperature, "top_p": ns.top_p},
        "client_processes": ns.processes, "http_stack": http_stack(),
        "offline_output_tok_s": off["output_tokens_per_s"],
        # the best closed-loop run's figures, then every run's
        "api_server_count": best["api_server_count"],
        "served_output_tok_s": best["served_output_tok_s"],
        "served_over_offline": best["served_over_offline"],
        "ttft_p50_ms": best["ttft_p50_ms"], "ttft_p99_ms": best["ttft_p99_ms"],
        "failed": sum(r["failed"] for r in runs), "offline": off, "runs": runs,
    }
    path = ns.out or (os.path.join(work, "smoke.json") if ns.smoke else
                      f"bench/results/serve/served-vs-offline-{ns.model}-c{ns.concurrency}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
