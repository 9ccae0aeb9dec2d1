"""The `gpu` stage of bench/fleet.py: one GPU, two engines sharing it (each sizes its KV cache
from half the memory), colocated (both prefill and decode; cache-aware routing) against one
prefill and one decode engine (router/pd.py), on a mixed workload of long prompts among
short chats: goodput under TTFT and TPOT objectives, TTFT and TPOT percentiles, and the KV
transfer rate the decode engine saw, as a fraction of the device-to-device copy rate
measured in the same run (before the engines take the memory).

    python bench/fleet.py --stages gpu [--gpu-model llama-3.1-8b] [--gpu-concurrency 32]

Dummy weights (throughput does not depend on their values) with bench/dummy_tokenizer.py's
word-level tokenizer, so that prompts are token-exact and the streamed text is real work.
With --smoke it runs on the CPU with the default model and a few requests (a check that the
stage works, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import urllib.request
from typing import Any

from fleet import HERE, Fleet, per_replica, router_metrics, run  # type: ignore[import-not-found]

from skyline.bench.workloads import WorkloadSpec


def copy_gbps(device: str, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate (GB/s, bytes copied once per copy) of one large buffer."""
    import torch

    if device == "cpu":
        nbytes = min(nbytes, 256 << 20)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    del x, y
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return nbytes * reps / seconds / 1e9


def replica_counters(replica: str, names: tuple[str, ...]) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{replica}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for n in names:
        m = re.search(rf"^skyline:{n}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        out[n] = float(m.group(1)) if m else 0.0
    return out


def stage_gpu(a: argparse.Namespace) -> dict[str, Any]:
    if a.smoke:
        device, flags = "cpu", ["--device", "cpu", "--kv-cache-memory", "128MiB"]
        wl = WorkloadSpec("mixed", "16", "4", long_fraction=0.5, long_len="160")
        concurrency, requests, pd_min = 2, 6, 64
    else:
        device = "cuda"
        model_dir = f"/tmp/skyline-fleet-{a.gpu_model}"
        subprocess.run([sys.executable, os.path.join(HERE, "dummy_tokenizer.py"), "--model",
                        a.gpu_model, "--out", model_dir], check=True)
        flags = ["--model", model_dir, "--load-format", "dummy", "--device", "cuda",
                 "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
        wl = WorkloadSpec("mixed", a.gpu_short_len, a.gpu_output_len,
                          long_fraction=a.gpu_long_fraction, long_len=a.gpu_long_len)
        concurrency, requests, pd_min = a.gpu_concurrency, a.gpu_requests, a.gpu_pd_min
    slos = {"ttft": a.ttft_slo_ms, "tpot": a.tpot_slo_ms}
    bandwidth = copy_gbps(device)
    print(f"device copy rate {bandwidth:.1f} GB/s", flush=True)
    setups = {"colocated (2 x both, cache-aware)": ["--policy", "cache-aware"],
              "prefill + decode": ["--role", "prefill,decode", "--pd-min-prompt-tokens",
                                   str(pd_min)]}
    rows: dict[str, Any] = {}
    keys = ("kv_transfer_loaded_bytes", "kv_transfer_load_seconds", "kv_transfer_loaded_blocks",
            "kv_transfer_load_failed_blocks")
    for name, extra in setups.items():
        fleet = Fleet([*flags, *extra], os.path.join(a.log_dir, f"gpu-{name[:9]}.log"))
        try:
            s = run(fleet.url, wl, concurrency, requests, endpoint="completions", warmup=1,
                    slos=slos)
            row = {"completed": s["completed"], "failed": s["failed"],
                   "request_goodput": s["goodput"]["request_goodput"],
                   "goodput_fraction": s["goodput"]["fraction"],
                   "output_throughput": s["output_throughput"],
                   "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"]}
            m = router_metrics(fleet.base)
            row["pd_prefills"] = sum(per_replica(m, "pd_prefills_total").values())
            if "decode" in name:
                t = {k: sum(replica_counters(r, keys)[k] for r in fleet.healthy())
                     for k in keys}
                rate = (t["kv_transfer_loaded_bytes"] / t["kv_transfer_load_seconds"] / 1e9
                        if t["kv_transfer_load_seconds"] else 0.0)
                row.update(transfer=t, transfer_gbps=rate,
                           transfer_fraction_of_copy_rate=rate / bandwidth)
            rows[name] = row
            print(name, row, flush=True)
        finally:
            fleet.stop()
    co, pd = rows[next(iter(setups))], rows["prefill + decode"]
    return {"rows": rows, "device_copy_gbps": bandwidth, "slos_ms": slos,
            "workload": vars(wl), "concurrency": concurrency, "requests": requests,
            "goodput_pd_over_colocated": (pd["request_goodput"] / co["request_goodput"]
                                          if co["request_goodput"] else None)}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gpu-model", default="llama-3.1-8b", help="a shipped config (dummy)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="shared by the two engines")
    ap.add_argument("--gpu-short-len", default="128:512", help="short chats' prompt tokens")
    ap.add_argument("--gpu-long-len", default="4096:8192", help="long prompts' tokens")
    ap.add_argument("--gpu-long-fraction", type=float, default=0.1)
    ap.add_argument("--gpu-output-len", default="128")
    ap.add_argument("--gpu-concurrency", type=int, default=32)
    ap.add_argument("--gpu-requests", type=int, default=400)
    ap.add_argument("--gpu-pd-min", type=int, default=1024,
                    help="prompts with fewer uncached tokens are prefilled where they decode")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=50.0)
