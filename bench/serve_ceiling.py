"""The API process's ceiling: how many streamed tokens per second it can deliver when the engine
costs (almost) nothing.

A tiny dummy-weight Llama (1 layer, hidden 64, a 4,096-word synthetic tokenizer: every token is
a word, so the server detokenizes and streams real text) is served by `skyline serve`; several
client processes (`skyline bench serve`'s load generator) keep CONCURRENCY streams in flight.
The API process's CPU seconds (from /proc, its threads included, the engine core excluded) per
delivered token give its ceiling, tokens / API CPU second, which does not depend on how many
cores the clients and the engine took from it on this machine; the delivered rate and TTFT are
reported beside it.

    python bench/serve_ceiling.py                       # 64 and 256 streams, 4 client processes
    python bench/serve_ceiling.py --levels 256 --tag after
    python bench/serve_ceiling.py --smoke               # 8 streams, a few seconds

On the GPU machine (served against offline at the same concurrency, a real model) use
`STAGES=served bash bench/device.sh`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

from skyline.bench.dummy_model import tiny_model_dir
from skyline.bench.frontier import start_server, stop_server
from skyline.bench.metrics import percentile
from skyline.bench.serve import LoadProcesses, LoadSpec, http_stack
from skyline.bench.workloads import WorkloadSpec


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads, not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds(server_pid: int) -> float:
    """CPU seconds of the server's child processes: the engine core (and a resource tracker)."""
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        return 0.0
    return sum(cpu_seconds(k) for k in kids)


def generated_tokens(url: str) -> float:
    """The server's count of tokens it generated and streamed (its Prometheus counter)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("skyline:generation_tokens_total{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


class HealthProbe:
    """GET /health every 50 ms from a thread: its answer times show event-loop stalls (a
    callback that holds the API process's loop delays every answer behind it)."""

    def __init__(self, url: str) -> None:
        self.url, self.seconds, self.stop = url + "/health", [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            t0 = time.perf_counter()
            try:
                urllib.request.urlopen(self.url, timeout=10).close()
            except OSError:
                continue
            self.seconds.append(time.perf_counter() - t0)

    def finish(self) -> list[float]:
        self.stop.set()
        self.thread.join()
        return self.seconds


def measure(url: str, server_pid: int, concurrency: int, processes: int, duration: float,
            input_len: int, output_len: int) -> dict[str, Any]:
    load = LoadSpec(base_url=url + "/v1", concurrency=concurrency, num_requests=None,
                    duration=duration, grace=5.0, setup_timeout=120.0)
    work = WorkloadSpec(name="random", input_len=str(input_len), output_len=str(output_len))
    clients = LoadProcesses(load, work, processes)
    try:
        # The clients start (process spawn, model id, one round of 4-token warm-up requests)
        # before their run's clock: the window opens once the run's own tokens flow, and
        # closes before the run's duration ends, so that no request is cut inside it.
        start = generated_tokens(url)
        ready_by = time.monotonic() + 120.0
        while (generated_tokens(url) < start + 5 * concurrency
               and time.monotonic() < ready_by):
            time.sleep(0.2)
        tok0 = generated_tokens(url)
        probe = HealthProbe(url)
        api0, eng0 = cpu_seconds(server_pid), children_cpu_seconds(server_pid)
        t0 = time.perf_counter()
        time.sleep(max(0.6 * duration, 1.0))
        api1, eng1 = cpu_seconds(server_pid), children_cpu_seconds(server_pid)
        t1 = time.perf_counter()
        tok1 = generated_tokens(url)
        health = probe.finish()
    finally:
        results, _ = clients.wait()
    ttft = [r.ttft for r in results if r.success and r.output_len]
    api_cpu, window_tokens = api1 - api0, tok1 - tok0
    return {
        "concurrency": concurrency, "client_processes": min(processes, concurrency),
        "window_s": round(t1 - t0, 2), "window_tokens": int(window_tokens),
        "requests_done": sum(r.success for r in results),
        "delivered_tok_s": round(window_tokens / (t1 - t0), 1),
        "api_cpu_s": round(api_cpu, 2),
        "engine_cpu_s": round(eng1 - eng0, 2),
        "api_us_per_token": round(1e6 * api_cpu / max(window_tokens, 1), 1),
        "api_ceiling_tok_s": round(window_tokens / max(api_cpu, 1e-9), 1),
        "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 1),
        # /health answer times during the window: event-loop stalls show here
        "health_p50_ms": round(1e3 * percentile(health, 50), 1),
        "health_max_ms": round(1e3 * max(health, default=0.0), 1),
    }


def merge(paths: list[str], out: str) -> None:
    """Runs of one variant (taken in turns with the others: this machine's load drifts) as one
    result: per level, the median of each figure, and every run."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    levels = []
    for i, row in enumerate(runs[0]["levels"]):
        rows = [r["levels"][i] for r in runs]
        med = {k: statistics.median(r[k] for r in rows) for k in row
               if isinstance(row[k], (int, float))}
        levels.append({**med, "runs": rows})
    result = {**runs[0], "levels": levels, "num_runs": len(runs),
              "dates": [r["date"] for r in runs]}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for row in levels:
        print({k: v for k, v in row.items() if k != "runs"})
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="64,256", help="streams in flight, e.g. 64,256")
    ap.add_argument("--processes", type=int, default=4, help="load-generator processes")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--tag", default="", help="ends the result file's name")
    ap.add_argument("--out-dir", default="bench/results/serve")
    ap.add_argument("--smoke", action="store_true", help="8 streams, 2 processes, 4 s")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge runs of one variant into their medians (in --out-dir/ceiling-"
                         "TAG.json) and exit")
    ns = ap.parse_args()
    if ns.merge:
        merge(ns.merge, os.path.join(ns.out_dir, f"ceiling-{ns.tag or 'merged'}.json"))
        return
    if ns.smoke:
        ns.levels, ns.processes, ns.duration, ns.output_len = "8", 2, 4.0, 32
    levels = [int(x) for x in ns.levels.split(",")]
    work = tempfile.mkdtemp(prefix="skyline-ceiling-")
    flags = ["--model", tiny_model_dir(work), "--load-format", "dummy", "--device", "cpu",
             "--threads", "1", "--max-num-seqs", str(max(levels)), "--max-model-len", "1024",
             "--kv-cache-memory", "512MiB"]
    proc, base = start_server(flags, os.path.join(work, "server.log"), 300.0)
    url = base.removesuffix("/v1")
    try:
        rows = []
        for c in levels:
            row = measure(url, proc.pid, c, min(ns.processes, c), ns.duration, ns.input_len,
                          ns.output_len)
            print(json.dumps(row))
            rows.append(row)
    finally:
        stop_server(proc)
    out = {
        "benchmark": "serve_ceiling",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/serve_ceiling.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "model": "tiny dummy Llama (1 layer, hidden 64, 4,096 words)",
        "http_stack": http_stack(), "input_len": ns.input_len, "output_len": ns.output_len,
        "levels": rows,
    }
    name = "smoke" if ns.smoke else "ceiling" + (f"-{ns.tag}" if ns.tag else "")
    path = os.path.join(tempfile.gettempdir() if ns.smoke else ns.out_dir, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
