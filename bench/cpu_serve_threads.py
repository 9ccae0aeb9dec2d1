"""Threads of a CPU server: `skyline serve` on the default model at several concurrency levels,
with one engine thread, with all of them, and with all of them but small steps on one thread
(the engine's default, `CPU_SERIAL_TOKENS` in skyline/worker/runner/launch.py).

    python bench/cpu_serve_threads.py [--threads 2] [--concurrency 1,2,4,8,16]
        [--flags "--dtype bfloat16 --quantization gguf"] [--out bench/results/cpu/F.json]
    python bench/cpu_serve_threads.py --smoke   # one server of a tiny random model

Random 128-token prompts, 128 output tokens (EOS ignored), `skyline bench serve`'s load
generator; each variant is a fresh server. The engine and the API server are two processes:
on a machine with few cores, the API process's work for every streamed token competes with
the engine's threads.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from typing import Any

from skyline.bench.frontier import start_server, stop_server
from skyline.bench.metrics import summarize
from skyline.bench.offline import machine_info, save_json
from skyline.bench.serve import LoadSpec, run_load
from skyline.bench.smoke import tiny_model
from skyline.bench.workloads import WorkloadSpec


def variants(threads: int) -> dict[str, tuple[int, str]]:
    """name -> (--threads, SKYLINE_CPU_SERIAL_TOKENS)."""
    return {"1 thread": (1, "0"), f"{threads} threads": (threads, "0"),
            f"{threads} threads, small steps on 1 (default)": (threads, "4")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--flags", default="--dtype bfloat16 --quantization gguf",
                    help="extra `skyline serve` flags")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="one variant, one stream, a tiny random model: 4 requests of 16 + 8")
    a = ap.parse_args()
    workload = WorkloadSpec("random", "128", "128")
    chosen = variants(a.threads)
    if a.smoke:
        a.flags = (f"--model {tiny_model()} --load-format dummy --kv-cache-memory 64MiB "
                   "--max-model-len 256")
        a.concurrency, a.requests_per_stream, a.out = "1", 1, None
        workload = WorkloadSpec("random", "16", "8")
        chosen = dict(list(chosen.items())[-1:])
    levels = [int(c) for c in a.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for name, (threads, serial) in chosen.items():
        os.environ["SKYLINE_CPU_SERIAL_TOKENS"] = serial
        flags = [*shlex.split(a.flags), "--threads", str(threads)]
        log = os.path.join(tempfile.gettempdir(), "cpu-serve-threads.log")
        proc, url = start_server(flags, log, timeout=300)
        try:
            for c in levels:
                load = LoadSpec(base_url=url, concurrency=c,
                                num_requests=max(4, c * a.requests_per_stream), warmup=1,
                                progress=False)
                results, duration, _, _ = run_load(load, workload)
                s = summarize(results, duration, None)
                rows.append({"variant": name, "threads": threads, "serial_tokens": int(serial),
                             "concurrency": c, "output_tok_s": s["output_throughput"],
                             "tpot_ms_p50": s["tpot_ms"]["median"],
                             "ttft_ms_p50": s["ttft_ms"]["median"]})
                print(f"{name:<40} c={c:<3} {s['output_throughput']:7.1f} tok/s  TPOT p50 "
                      f"{s['tpot_ms']['median']:6.1f} ms", flush=True)
        finally:
            stop_server(proc)
    res = {"benchmark": "cpu_serve_threads", "command": "python " + " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "flags": a.flags,
           "rows": rows, "machine": machine_info("cpu")}
    save_json(res, a.out)


if __name__ == "__main__":
    main()
