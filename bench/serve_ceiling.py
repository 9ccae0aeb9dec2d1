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
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from skyline.bench.dummy_model import write_model_dir
from skyline.bench.metrics import percentile
from skyline.bench.serve import LoadSpec, run_load
from skyline.bench.workloads import WorkloadSpec

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "vocab_size": 4096, "bos_token_id": 4094, "eos_token_id": 4095,
}


def tiny_model_dir(root: str) -> str:
    src = os.path.join(root, "config")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return write_model_dir(src, os.path.join(root, "model"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads, not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve_ceiling: the server exited (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    sys.exit("serve_ceiling: the server did not start in time")


def children_cpu_seconds(server_pid: int) -> float:
    """CPU seconds of the server's child processes: the engine core (and a resource tracker)."""
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        return 0.0
    return sum(cpu_seconds(k) for k in kids)


def _client(args: tuple[str, int, float, int, int, int]) -> dict[str, Any]:
    url, concurrency, duration, input_len, output_len, seed = args
    load = LoadSpec(base_url=url + "/v1", concurrency=concurrency, num_requests=None,
                    duration=duration, progress=False, seed=seed, grace=5.0,
                    setup_timeout=120.0)
    work = WorkloadSpec(name="random", input_len=str(input_len), output_len=str(output_len),
                        seed=seed)
    results, _, _, _ = run_load(load, work)
    ok = [r for r in results if r.success]
    return {"ttft": [r.ttft for r in ok if r.output_len]}


def generated_tokens(url: str) -> float:
    """The server's count of tokens it generated and streamed (its Prometheus counter)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("skyline:generation_tokens_total{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure(url: str, server_pid: int, concurrency: int, processes: int, duration: float,
            input_len: int, output_len: int) -> dict[str, Any]:
    per = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    jobs = [(url, c, duration, input_len, output_len, i) for i, c in enumerate(per) if c]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(len(jobs)) as pool:
        pending = pool.map_async(_client, jobs)
        # The clients warm up first (one round of 4-token requests); the window starts after.
        time.sleep(min(3.0, duration / 4))
        tok0 = generated_tokens(url)
        api0, eng0 = cpu_seconds(server_pid), children_cpu_seconds(server_pid)
        t0 = time.perf_counter()
        # The window ends before the clients' duration does: no request is cut inside it.
        time.sleep(max(duration - 2 * min(3.0, duration / 4), 1.0))
        api1, eng1 = cpu_seconds(server_pid), children_cpu_seconds(server_pid)
        t1 = time.perf_counter()
        tok1 = generated_tokens(url)
        outs = pending.get()
    ttft = [t for o in outs for t in o["ttft"]]
    api_cpu, window_tokens = api1 - api0, tok1 - tok0
    return {
        "concurrency": concurrency, "client_processes": len(jobs),
        "window_s": round(t1 - t0, 2), "window_tokens": int(window_tokens),
        "requests_done": sum(len(o["ttft"]) for o in outs),
        "delivered_tok_s": round(window_tokens / (t1 - t0), 1),
        "api_cpu_s": round(api_cpu, 2),
        "engine_cpu_s": round(eng1 - eng0, 2),
        "api_us_per_token": round(1e6 * api_cpu / max(window_tokens, 1), 1),
        "api_ceiling_tok_s": round(window_tokens / max(api_cpu, 1e-9), 1),
        "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 1),
    }


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
    ns = ap.parse_args()
    if ns.smoke:
        ns.levels, ns.processes, ns.duration, ns.output_len = "8", 2, 4.0, 32
    levels = [int(x) for x in ns.levels.split(",")]
    work = tempfile.mkdtemp(prefix="skyline-ceiling-")
    model = tiny_model_dir(work)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "skyline.cli", "serve", "--model", model, "--load-format",
           "dummy", "--device", "cpu", "--threads", "1", "--max-num-seqs", str(max(levels)),
           "--max-model-len", "1024", "--kv-cache-memory", "512MiB",
           "--port", str(port), "--uvicorn-log-level", "warning"]
    log = open(os.path.join(work, "server.log"), "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, 300.0)
        rows = []
        for c in levels:
            row = measure(url, proc.pid, c, min(ns.processes, c), ns.duration, ns.input_len,
                          ns.output_len)
            print(json.dumps(row))
            rows.append(row)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    out = {
        "benchmark": "serve_ceiling",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/serve_ceiling.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "model": "tiny dummy Llama (1 layer, hidden 64, 4,096 words)",
        "input_len": ns.input_len, "output_len": ns.output_len, "levels": rows,
    }
    name = "smoke" if ns.smoke else "ceiling" + (f"-{ns.tag}" if ns.tag else "")
    path = os.path.join(tempfile.gettempdir() if ns.smoke else ns.out_dir, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
