"""A GPU and its host's CPU against llama.cpp's partial offload, on the same GGUF file, in one run.

    python bench/offload_vs_llamacpp.py --llama-bin DIR [--gguf PATH] [--cpu-layers 4]
    python bench/offload_vs_llamacpp.py --smoke   # CPU stages, a tiny file, no llama.cpp

The file: Llama-3.1-8B's shape in BF16, random weights and a synthetic vocabulary of its
128,256 tokens (skyline/bench/random_gguf.py), written to --gguf where missing (16 GB, about a
minute). Two layouts, each engine's batch-1 decode (N tokens one at a time after a one-token
prompt, the time past the first token; llama-bench's tg N: N tokens from an empty context):

- split: C = --cpu-layers layers and the LM head on the CPU, the rest on the GPU (skyline
  `--placement cuda:0=L-C,cpu=C`: the last C layers; llama.cpp `-ngl L-C`: its first C layers
  and its output layer stay on the CPU). The same bytes on each device either way.
- gpu: the whole model on the GPU (`-ngl 99`).

The floor of each layout is each part's weight bytes over its own memory's rate, both measured
in this run (the GPU's copy bandwidth, the host's read bandwidth at all its cores). llama.cpp
runs at --threads and at half of them (or at each of --peer-threads), and its faster result is
the peer; skyline's CPU stage takes the host's cores (its default). llama.cpp goes first, both
layouts (or those of --layouts), --reps repetitions each; then skyline, one engine per layout,
the median of --reps timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from gguf import GGUFReader

from skyline import LLM, SamplingParams
from skyline.bench.floor import copy_bandwidth, host_read_bandwidth
from skyline.bench.offline import machine_info, save_json
from skyline.bench.random_gguf import LLAMA_3_1_8B, TINY_DENSE, write_dense_gguf


def part_bytes(path: str, cpu_layers: int) -> tuple[int, int, int]:
    """(layers, bytes a decode step reads on the GPU, on the CPU) of the split layout: the
    first layers on one device and C layers with the LM head on the other (which C layers
    does not matter: every layer's tensors have the same size)."""
    r = GGUFReader(path)
    layers = int(r.fields["llama.block_count"].contents())
    per_layer = sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("blk.0."))
    head = sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("output"))
    return layers, (layers - cpu_layers) * per_layer, cpu_layers * per_layer + head


def llama_bench(llama_bin: str, path: str, ngl: list[int], threads: list[int], gen: int,
                reps: int) -> list[dict[str, Any]]:
    cmd = [os.path.join(llama_bin, "llama-bench"), "-m", path, "-p", "0", "-n", str(gen),
           "-r", str(reps), "-ngl", ",".join(map(str, ngl)),
           "-t", ",".join(map(str, threads)), "-o", "json"]
    print("$", " ".join(cmd), flush=True)
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return [{"n_gpu_layers": r["n_gpu_layers"], "threads": r["n_threads"],
             "decode_tok_s": r["avg_ts"], "samples_tok_s": r.get("samples_ts"),
             "build": r.get("build_commit"), "gpu": r.get("gpu_info")} for r in rows]


def skyline_decode(path: str, engine: dict[str, Any], gen: int, reps: int
                   ) -> tuple[list[float], dict[str, float], list[dict[str, Any]]]:
    """Decode rates of `reps` timings, the driver's (the last stage's rank) milliseconds a
    step by part over them (the `cpu_step_seconds` query: its layers, LM head, sampling and
    host phases; its wait for the stage before it is in none of them), and the kernels of each
    CPU rank (the `describe` query's cpu_kernels)."""
    llm = LLM(path, max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False, **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        llm.generate([[1]], params)  # warm-up (and CUDA graphs)
        before = llm.query("cpu_step_seconds")  # the first call starts the clocks
        before = llm.query("cpu_step_seconds")
        rates = []
        for _ in range(reps):
            m = llm.generate([[1]], params)[0].metrics
            rates.append((gen - 1) / (m["e2e"] - m["ttft"]))
        after = llm.query("cpu_step_seconds")
        steps = reps * gen
        kernels = llm.query("describe")["cpu_kernels"]
        return rates, {k: 1e3 * (after[k] - before[k]) / steps for k in after}, kernels
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=None, help="directory of llama-bench (CUDA build)")
    ap.add_argument("--gguf", default=None,
                    help="the file (written where missing; default: a temporary directory)")
    ap.add_argument("--cpu-layers", type=int, default=4)
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per timing")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="llama.cpp's threads (and half of them)")
    ap.add_argument("--peer-threads", type=int, nargs="+", default=None,
                    help="llama.cpp's thread counts (default: --threads and half of it)")
    ap.add_argument("--layouts", nargs="+", choices=("split", "gpu"), default=["split", "gpu"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny file, both layouts as CPU stages, skyline only, 1 repetition")
    ns = ap.parse_args()
    if not ns.smoke and not torch.cuda.is_available():
        sys.exit("offload_vs_llamacpp.py needs a CUDA GPU (or --smoke)")
    gpu = "cpu" if ns.smoke else "cuda:0"
    if ns.smoke:
        ns.gen, ns.reps, ns.cpu_layers = 8, 1, 1
    path = ns.gguf or os.path.join(tempfile.mkdtemp(prefix="skyline-offload-"),
                                   "tiny.gguf" if ns.smoke else "llama-3.1-8b-bf16.gguf")
    if not os.path.exists(path):
        t = time.perf_counter()
        write_dense_gguf(path, TINY_DENSE if ns.smoke else LLAMA_3_1_8B)
        print(f"wrote {path} ({os.path.getsize(path) / 1e9:.1f} GB) in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    layers, gpu_bytes, cpu_bytes = part_bytes(path, ns.cpu_layers)
    gpu_bw = copy_bandwidth(torch.device(gpu))
    host_bw = host_read_bandwidth()
    floors = {"split": 1 / (gpu_bytes / gpu_bw + cpu_bytes / host_bw),
              "gpu": gpu_bw / (gpu_bytes + cpu_bytes)}
    print(f"floors: split {floors['split']:.1f} tok/s ({gpu_bytes / 2**30:.2f} GiB at "
          f"{gpu_bw / 1e9:.0f} GB/s + {cpu_bytes / 2**30:.2f} GiB at {host_bw / 1e9:.0f} GB/s), "
          f"gpu {floors['gpu']:.1f} tok/s", flush=True)

    llama_rows: list[dict[str, Any]] = []
    if ns.llama_bin:
        threads = ns.peer_threads or sorted({ns.threads, max(1, ns.threads // 2)})
        ngls = {"split": layers - ns.cpu_layers, "gpu": 99}
        llama_rows = llama_bench(ns.llama_bin, path, [ngls[k] for k in ns.layouts], threads,
                                 ns.gen, ns.reps)
        for r in llama_rows:
            print(f"llama.cpp -ngl {r['n_gpu_layers']} -t {r['threads']}: "
                  f"{r['decode_tok_s']:.1f} tok/s", flush=True)

    placements = {"split": f"{gpu}={layers - ns.cpu_layers},cpu={ns.cpu_layers}", "gpu": None}
    runs = {}
    for layout in ns.layouts:
        placement = placements[layout]
        engine: dict[str, Any] = {"device": "cpu"} if ns.smoke else {}
        if placement:
            engine["placement"] = placement
        rates, step_ms, kernels = skyline_decode(path, engine, ns.gen, ns.reps)
        ngl = layers - ns.cpu_layers if layout == "split" else 99
        peer = max((r["decode_tok_s"] for r in llama_rows if r["n_gpu_layers"] == ngl),
                   default=None)
        sky, floor = statistics.median(rates), floors[layout]
        runs[layout] = {
            "skyline_placement": placement, "llamacpp_n_gpu_layers": ngl,
            "skyline_decode_tok_s": rates, "skyline_median_tok_s": sky,
            "skyline_driver_ms_per_step": step_ms, "skyline_cpu_kernels": kernels,
            "llamacpp_best_tok_s": peer, "floor_tok_s": floor,
            "skyline_fraction_of_floor": sky / floor,
            "llamacpp_fraction_of_floor": peer / floor if peer else None,
            "skyline_over_llamacpp": sky / peer if peer else None}
        line = f"{layout}: skyline {sky:.1f} tok/s ({sky / floor:.2f} of the floor {floor:.1f})"
        if peer:
            line += f", llama.cpp {peer:.1f} ({peer / floor:.2f}): {sky / peer:.2f}x"
        print(line, flush=True)
        print("  the driver's ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in step_ms.items()),
              flush=True)
        for k in kernels:
            print(f"  a CPU rank's kernels: {k}", flush=True)

    result = {"benchmark": "offload_vs_llamacpp", "date": datetime.date.today().isoformat(),
              "machine": machine_info(gpu), "gguf": os.path.basename(path),
              "gguf_bytes": os.path.getsize(path), "layers": layers,
              "cpu_layers": ns.cpu_layers, "gen_tokens": ns.gen, "reps": ns.reps,
              "device_bandwidth_Bps": gpu_bw, "host_read_bandwidth_Bps": host_bw,
              "gpu_weight_bytes_split": gpu_bytes, "cpu_weight_bytes_split": cpu_bytes,
              "llamacpp": llama_rows, "runs": runs}
    out = ns.out or ("bench/results/parallel/offload-vs-llamacpp-smoke.json" if ns.smoke else
                     "bench/results/parallel/offload-vs-llamacpp-llama-3.1-8b.json")
    save_json(result, out)


if __name__ == "__main__":
    main()
