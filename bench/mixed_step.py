"""Mixed steps (a prefill chunk beside the decodes, as staggered arrivals make most steps of a
server): the forward run eagerly against replayed from a CUDA graph, each against its floor
(FLOPs over the bf16 matmul peak, bytes over the copy bandwidth, both measured in the same
run), on Llama-3.1-8B with dummy weights (H200).

  python bench/mixed_step.py --out bench/results/serve/mixed-step-h200-llama-3.1-8b.json
  python bench/mixed_step.py --smoke   # a tiny random model on the CPU: the code only

For each chunk (default 128, 512, 2048 tokens: a fresh prompt's first chunk) beside 256
decodes at a 300-token context: eager (what a served mixed step costs without graphs), a graph
of exactly the step's tokens, and the engine's own graph for it (the padded mixed shape it
picks, worker/cuda_graph.py: mixed_sizes; none past MAX_MIXED_TOKENS, where the engine runs
the step eagerly). Floor = max(FLOPs / peak, bytes / bandwidth): the Linears' 2 FLOPs a weight
per token, attention's per query-key pair (decodes: the context and the new token; the chunk:
causal), every weight read once, the decodes' K/V read once (the LM head is outside the forward:
not counted). Steps/s are back-to-back forwards (the host runs ahead of the GPU, as a served
step loop does), so eager reads max(host, GPU) time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from skyline.bench.floor import copy_bandwidth, matmul_peak
from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.engine.frontend.llm import LLM


def floor_s(cost, num_decodes: int, context: int, chunk: int, peak: float, bw: float,
            dtype_bytes: int) -> dict[str, float]:
    """The step's FLOPs, bytes and floor seconds (module docstring)."""
    tokens = num_decodes + chunk
    pairs = num_decodes * (context + 1) + chunk * (chunk + 1) / 2
    flops = 2 * cost.linear_params * tokens + cost.attn_flops_per_pair * pairs
    weights = cost.weight_bytes - cost.head_params * dtype_bytes
    nbytes = weights + cost.kv_bytes_per_token * (num_decodes * (context + 1) + chunk)
    return {"flops": flops, "bytes": nbytes,
            "floor_s": max(flops / peak, nbytes / bw)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--decodes", type=int, default=256)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's (default decodes + 1): the sequences every mixed graph "
                         "has, so more than the step's measures the padding sequences' cost")
    ap.add_argument("--out", default=None,
                    help="JSON path (default $OUT/mixed-step-<model>.json, else "
                         "bench/results/serve/)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, a few decodes, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("mixed_step", a.smoke)
    if a.smoke:
        a.model, a.decodes, a.context, a.chunks, a.reps = tiny_model(), 4, 20, [8, 24], 2
    name = "smoke" if a.smoke else os.path.basename(a.model)
    out = a.out or os.path.join(os.environ.get("OUT") or "bench/results/serve",
                                f"mixed-step-{name}.json")
    dev = torch.device(device)
    peak, bw = matmul_peak(dev), copy_bandwidth(dev)
    if device == "cuda":
        torch.cuda.empty_cache()
    budget = a.decodes + max(a.chunks)
    llm = LLM(a.model, load_format=a.load_format, device=device,
              max_num_seqs=a.max_num_seqs or a.decodes + 1,
              # room beside the KV cache for the probe's graphs of exactly each step's tokens
              gpu_memory_utilization=0.8,
              max_num_batched_tokens=budget, max_model_len=max(a.context + 64, budget + 64))
    cost = llm.query("model_cost")
    dtype_bytes = torch.finfo(getattr(torch, llm.config.model.dtype)).bits // 8
    rows = llm.query("mixed_step_seconds", a.decodes, a.context, a.chunks, a.reps)
    info = llm.query("describe")
    llm.shutdown()
    # (rows start with "==": bench/device.sh shows those lines of a stage)
    print(f"== {'chunk':>6} {'tokens':>6} {'floor ms':>9} {'eager ms':>9} {'graph ms':>9} "
          f"{'engine ms (tokens)':>19} {'eager/floor':>11} {'graph/floor':>11}")
    for row in rows:
        row |= floor_s(cost, a.decodes, a.context, row["chunk"], peak, bw, dtype_bytes)
        f = row["floor_s"]
        row["eager_over_floor"] = row["eager_s"] / f
        row["graph_over_floor"] = row["graph_s"] / f if row["graph_s"] else None
        row["eager_over_graph"] = row["eager_s"] / row["graph_s"] if row["graph_s"] else None

        def ms(x):
            return f"{x * 1e3:9.2f}" if x is not None else f"{'-':>9}"

        engine = (f"{ms(row['engine_graph_s'])} ({row['engine_shape']})"
                  if row["engine_shape"] else f"{'eager':>19}")
        print(f"== {row['chunk']:>6} {row['num_tokens']:>6} {ms(f)} {ms(row['eager_s'])} "
              f"{ms(row['graph_s'])} {engine:>19} {row['eager_over_floor']:>11.2f} "
              + (f"{row['graph_over_floor']:>11.2f}" if row["graph_s"] else f"{'-':>11}"))
    res = {
        "benchmark": "mixed_step",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "python bench/mixed_step.py" + (" --smoke" if a.smoke else ""),
        "model": name, "dtype": llm.config.model.dtype, "decodes": a.decodes,
        "context": a.context, "reps": a.reps, "max_num_seqs": a.max_num_seqs or a.decodes + 1,
        "matmul_peak_TFLOPs": peak / 1e12,
        "copy_bandwidth_TBps": bw / 1e12, "num_cuda_graphs": info["num_cuda_graphs"],
        "num_mixed_cuda_graphs": info["num_mixed_cuda_graphs"],
        "cuda_graph_capture_seconds": info["cuda_graph_capture_seconds"], "rows": rows,
        "machine": machine_info(device),
    }
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    save_json(res, out)


if __name__ == "__main__":
    main()
