"""skyline against llama.cpp's `llama-server` on the same GGUF file, on the CPU, in one run.

    python bench/llamacpp_serve.py --llama-server /path/to/llama-server \
        [--threads 2] [--rounds 2]
        [--out bench/results/llamacpp/llamacpp-vs-skyline-cpu-smollm2.json]
    python bench/llamacpp_serve.py --smoke   # skyline's server only, a tiny random model

Both servers load the embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF), listen on
127.0.0.1, use the same number of CPU threads and have 16 sequence slots with continuous
batching. skyline runs as it does by default on the CPU (GGUF weights dequantized to float32 at
load); llama.cpp computes on the packed Q4_1 blocks. Both are driven by `skyline bench serve`'s
load generator (`skyline.bench.serve.run_load`) with the same requests:

- random: 128 prompt tokens (token-exact, via each server's /tokenize), 128 output tokens;
- chat: two-turn conversations on /v1/chat/completions (each server's own chat template),
  48-96 words a turn, 32-96 output tokens a turn.

Every request ignores EOS (with min_tokens = max_tokens), so both engines generate the same
number of tokens; the mean output tokens per engine are reported as a check. Each
(workload, concurrency) cell is split into `--rounds` rounds; the engines alternate within the
cell (skyline first in even rounds, llama.cpp first in odd ones), each round with fresh prompts
that both engines receive. The machine's CPU is shared, so alternation lets both engines see
the same background noise. Both servers stay up for the whole run; neither uses CPU while idle
(measured at the start and written to the JSON).

Threads: when other work already keeps the cores busy, two threads per engine collapse (both
runtimes synchronise their threads at every operation, and a descheduled thread stalls the
other); `--threads 1` measures the engines rather than the contention on such a machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from skyline.bench.frontier import start_server, stop_server
from skyline.bench.metrics import RequestResult, summarize
from skyline.bench.offline import machine_info, save_json
from skyline.bench.serve import LoadSpec, run_load
from skyline.bench.smoke import tiny_model
from skyline.bench.workloads import WorkloadSpec
from skyline.engine.create import resolve_model_path

ENGINES = ("skyline", "llama.cpp")
# name -> (endpoint, workload); request counts per concurrency level come from the flags.
WORKLOADS = {
    "random-128-128": ("completions", WorkloadSpec("random", "128", "128")),
    "chat-2turn": ("chat", WorkloadSpec("multi-turn", "48:96", "32:96", num_turns=2)),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(binary: str, model: str, threads: int, slots: int, ctx_per_slot: int,
                       log_path: str, timeout: float) -> tuple[subprocess.Popen, str, list[str]]:
    """llama-server on a free port; returns the process, its /v1 URL and its command line."""
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"{binary} is not an executable llama-server; pass --llama-server PATH")
    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-c", str(slots * ctx_per_slot), "--cont-batching", "--no-webui"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{port}/v1", cmd
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-600:]
    raise SystemExit(f"llama-server did not start: {tail}")


def llama_version(binary: str) -> str:
    p = subprocess.run([binary, "--version"], capture_output=True, text=True, errors="replace")
    return " ".join((p.stdout + p.stderr).split())[:200]


def idle_cpu(procs: dict[str, subprocess.Popen], seconds: float = 3.0) -> dict[str, float]:
    """CPU seconds per second each server (with its child processes) uses while idle."""
    try:
        import psutil  # not a dependency of skyline: only this measurement needs it
    except ImportError:
        raise SystemExit("llamacpp_serve needs psutil to measure the servers' idle CPU; "
                         "pip install psutil") from None

    def cpu(pid: int) -> float:
        p = psutil.Process(pid)
        total = 0.0
        for q in [p, *p.children(recursive=True)]:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    before = {k: cpu(p.pid) for k, p in procs.items()}
    time.sleep(seconds)
    return {k: round((cpu(p.pid) - before[k]) / seconds, 3) for k, p in procs.items()}


def cell_summary(results: list[RequestResult], duration: float) -> dict[str, Any]:
    s = summarize(results, duration)
    ok = [r for r in results if r.success]
    s["mean_input_tokens"] = sum(r.input_len for r in ok) / max(len(ok), 1)
    s["mean_output_tokens"] = sum(r.output_len for r in ok) / max(len(ok), 1)
    return s


def run_cell(urls: dict[str, str], endpoint: str, workload: WorkloadSpec, concurrency: int,
             per_round: int, rounds: int, seed: int) -> dict[str, Any]:
    """One (workload, concurrency) cell: `rounds` rounds of `per_round` requests (turns) per
    engine, engines alternating."""
    engines = [e for e in ENGINES if e in urls]
    acc: dict[str, tuple[list[RequestResult], list[float]]] = {e: ([], []) for e in engines}
    exact: dict[str, bool] = {}
    load_avg: dict[str, list[float]] = {e: [] for e in engines}
    for r in range(rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        wl = dataclasses.replace(workload, seed=seed + 1000 * r)
        for engine in order:
            load = LoadSpec(base_url=urls[engine], endpoint=endpoint, concurrency=concurrency,
                            num_requests=per_round, ignore_eos=True, temperature=0.0,
                            warmup=1, progress=False)
            results, duration, token_exact, _ = run_load(load, wl)
            acc[engine][0].extend(results)
            acc[engine][1].append(duration)
            load_avg[engine].append(round(os.getloadavg()[0], 2))
            exact[engine] = token_exact
            s = cell_summary(results, duration)
            print(f"  round {r} {engine:<9} {s['completed']:>3} ok {s['failed']} failed "
                  f"{s['output_throughput']:7.1f} tok/s  TTFT p50 {s['ttft_ms']['median']:7.0f} "
                  f"ms  TPOT p50 {s['tpot_ms']['median']:6.1f} ms  "
                  f"out {s['mean_output_tokens']:.1f}", flush=True)
    out: dict[str, Any] = {"concurrency": concurrency, "requests_per_engine": per_round * rounds,
                           "rounds": rounds, "engines": {}}
    for engine, (results, durations) in acc.items():
        s = cell_summary(results, sum(durations))
        s["token_exact_prompts"] = exact[engine]
        s["round_durations_s"] = durations
        s["load_avg_1min_after_rounds"] = load_avg[engine]
        out["engines"][engine] = s
    if len(engines) < 2:
        return out
    sky, ref = out["engines"]["skyline"], out["engines"]["llama.cpp"]
    out["skyline_over_llamacpp"] = {
        "output_throughput": sky["output_throughput"] / ref["output_throughput"],
        "ttft_median": sky["ttft_ms"]["median"] / ref["ttft_ms"]["median"],
        "tpot_median": sky["tpot_ms"]["median"] / ref["tpot_ms"]["median"],
    }
    return out


def smoke(ns: argparse.Namespace) -> None:
    """The skyline side of every workload cell, on a tiny random model (no llama.cpp)."""
    print("llamacpp_serve --smoke: no llama-server; its side is skipped, skyline serves a tiny "
          "random model", flush=True)
    os.makedirs(ns.log_dir, exist_ok=True)
    flags = ["--model", tiny_model(), "--load-format", "dummy", "--threads", str(ns.threads),
             "--max-num-seqs", "2", "--max-model-len", "512", "--kv-cache-memory", "64MiB"]
    proc, url = start_server(flags, os.path.join(ns.log_dir, "skyline-smoke.log"), 120.0)
    try:
        for name, (endpoint, workload) in WORKLOADS.items():
            small = dataclasses.replace(workload, input_len="16", output_len="4")
            cell = run_cell({"skyline": url}, endpoint, small, 1, 2, 1, seed=1)
            print(name, cell["engines"]["skyline"]["completed"], "completed", flush=True)
    finally:
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", default=None,
                    help="path of llama.cpp's llama-server (required)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16, help="parallel sequences of each server")
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--convs-c1", type=int, default=2,
                    help="conversations per engine and round at c=1")
    ap.add_argument("--convs-per-stream", type=int, default=1,
                    help="conversations per engine, round and stream at c>1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--skyline-flags", default="", help="extra `skyline serve` flags")
    ap.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "llamacpp-serve-logs"))
    ap.add_argument("--out", default="bench/results/llamacpp/llamacpp-vs-skyline-cpu-smollm2.json")
    ap.add_argument("--smoke", action="store_true",
                    help="skyline's server of a tiny random model alone, one round of 2 "
                         "requests per workload, no JSON")
    ns = ap.parse_args()
    if ns.smoke:
        smoke(ns)
        return
    if ns.llama_server is None:
        ap.error("--llama-server is required")
    levels = [int(c) for c in ns.concurrency.split(",")]
    names = ns.workloads.split(",")
    if unknown := [n for n in names if n not in WORKLOADS]:
        raise SystemExit(f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    if max(levels) > ns.slots:
        raise SystemExit(f"--concurrency {max(levels)} exceeds --slots {ns.slots}")
    model = ns.model or resolve_model_path(None, "auto")  # the embedded default model
    os.makedirs(ns.log_dir, exist_ok=True)
    t_start = time.time()

    sky_flags = ["--model", model, "--threads", str(ns.threads), "--max-num-seqs",
                 str(ns.slots), "--max-model-len", str(ns.ctx_per_slot),
                 "--kv-cache-memory", "1GiB", *shlex.split(ns.skyline_flags)]
    sky_proc, sky_url = start_server(sky_flags, os.path.join(ns.log_dir, "skyline.log"), 600.0)
    try:
        llama_proc, llama_url, llama_cmd = start_llama_server(
            ns.llama_server, model, ns.threads, ns.slots, ns.ctx_per_slot,
            os.path.join(ns.log_dir, "llama-server.log"), 300.0)
    except BaseException:
        stop_server(sky_proc)
        raise
    procs = {"skyline": sky_proc, "llama.cpp": llama_proc}
    urls = {"skyline": sky_url, "llama.cpp": llama_url}
    try:
        idle = idle_cpu(procs)
        print(f"idle CPU (cores busy): {idle}", flush=True)
        cells = []
        for name in names:
            endpoint, workload = WORKLOADS[name]
            for c in levels:
                convs = ns.convs_c1 if c == 1 else ns.convs_per_stream * c
                turns = workload.num_turns if workload.name == "multi-turn" else 1
                n = convs * turns  # every conversation runs all its turns
                print(f"{name}, concurrency {c}: {ns.rounds} x {n} requests per engine",
                      flush=True)
                cell = run_cell(urls, endpoint, workload, c, n, ns.rounds, seed=c)
                cell |= {"workload": name, "endpoint": endpoint,
                         "workload_spec": dataclasses.asdict(workload)}
                cells.append(cell)
    finally:
        stop_server(llama_proc)
        stop_server(sky_proc)

    llama_cmd[llama_cmd.index("--port") + 1] = "<free>"
    sky_cmd = [sys.executable, "-m", "skyline.cli", "serve", "--port", "<free>", *sky_flags]
    report = {
        "benchmark": "llamacpp-vs-skyline-serve",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + shlex.join(sys.argv),
        "machine": machine_info("cpu") | {"load_avg_at_end": os.getloadavg()},
        "model": model,
        "servers": {"skyline": shlex.join(sky_cmd), "llama.cpp": shlex.join(llama_cmd)},
        "llama_cpp_version": llama_version(ns.llama_server),
        "protocol": "same requests for both engines; temperature 0, ignore_eos with min_tokens "
                    "= max_tokens; each cell split into rounds with the engines alternating "
                    "(skyline first in even rounds), both servers up for the whole run, on a "
                    "CPU shared with other work; TTFT/TPOT/ITL/E2E in ms; throughput = output "
                    "tokens / summed round durations",
        "idle_cpu_cores": idle,
        "total_seconds": round(time.time() - t_start, 1),
        "cells": cells,
    }
    save_json(report, ns.out)
    print("\n| workload | c | engine | output tok/s | TTFT p50 | TPOT p50 | TPOT p99 | "
          "ITL p50 | mean out |\n|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        for engine, s in cell["engines"].items():
            print(f"| {cell['workload']} | {cell['concurrency']} | {engine} | "
                  f"{s['output_throughput']:.1f} | {s['ttft_ms']['median']:.0f} ms | "
                  f"{s['tpot_ms']['median']:.1f} ms | {s['tpot_ms']['p99']:.1f} ms | "
                  f"{s['itl_ms']['median']:.1f} ms | {s['mean_output_tokens']:.1f} |")
    print(json.dumps({f"{c['workload']} c={c['concurrency']}": c["skyline_over_llamacpp"]
                      for c in cells}, indent=1))


if __name__ == "__main__":
    main()
