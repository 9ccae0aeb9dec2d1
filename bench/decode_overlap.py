"""Large decode steps as two halves whose attention overlaps the other half's matrix products,
against the step as the engine runs it (worker/overlap_probe.py), with the step's floors
measured in the same run: the KV cache's bytes over the copy bandwidth (attention), the
Linears' FLOPs over the matmul peak of the weights' format (products), their sum (one after
the other) and their max (perfectly overlapped).

  python bench/decode_overlap.py --quantization fp8 --kv-cache-dtype fp8 \\
      --batch 512 1024 --context 1000 1500 --carveouts 16 32
  python bench/decode_overlap.py --smoke   # a tiny random model on the CPU: the code only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from skyline.bench.floor import copy_bandwidth, matmul_peak
from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.engine.frontend.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--context", type=int, nargs="+", default=[1000])
    ap.add_argument("--carveouts", type=int, nargs="*", default=[16, 32],
                    help="SMs cuBLAS leaves free in the alternate-smN variants")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, a few decodes, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("decode_overlap", a.smoke)
    extra = {}
    if a.smoke:
        a.model, a.batch, a.context, a.reps = tiny_model(), [6], [40], 2
        extra = {"kv_cache_memory": "64MiB"}
    name = "smoke" if a.smoke else os.path.basename(a.model)
    out = a.out or os.path.join(os.environ.get("OUT") or "bench/results/offline",
                                f"decode-overlap-{name}.json")
    dev = torch.device(device)
    fp8 = a.quantization == "fp8" and device == "cuda"
    peak, bw = matmul_peak(dev, fp8=fp8), copy_bandwidth(dev)
    if device == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(a.model, load_format=a.load_format, device=device, enforce_eager=True,
              quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
              max_num_seqs=max(a.batch), max_model_len=max(a.context) + 64,
              gpu_memory_utilization=0.85, **extra)
    cost = llm.query("model_cost")
    rows = []
    for ctx in a.context:
        for b in a.batch:
            try:
                got = llm.query("decode_overlap_seconds", b, ctx, tuple(a.carveouts), a.reps)
            except ValueError as e:  # the cache cannot hold the batch
                print(f"== batch {b} context {ctx}: skipped ({e})")
                continue
            attn = b * (ctx + 1) * cost.kv_bytes_per_token / bw
            linear = 2 * cost.linear_params * b / peak
            for row in got:
                row |= {"attention_floor_s": attn, "linear_floor_s": linear,
                        "sequential_floor_s": attn + linear,
                        "overlapped_floor_s": max(attn, linear)}
                if row["seconds"] is None:
                    print(f"== batch {b:5d} context {ctx:5d} {row['variant']:>16}: failed "
                          f"({row['error']})")
                    continue
                print(f"== batch {b:5d} context {ctx:5d} {row['variant']:>16}: "
                      f"{row['seconds'] * 1e3:8.2f} ms = {row['over_one']:.3f}x one, "
                      f"{(attn + linear) / row['seconds']:.2f} of the sequential floor "
                      f"({(attn + linear) * 1e3:.2f} ms), "
                      f"{max(attn, linear) / row['seconds']:.2f} of the overlapped "
                      f"({max(attn, linear) * 1e3:.2f} ms); diff {row['max_rel_diff']:.1e}")
            rows += got
    llm.shutdown()
    res = {"benchmark": "decode_overlap",
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "command": " ".join(["python bench/decode_overlap.py", *sys.argv[1:]]),
           "model": name, "quantization": a.quantization, "kv_cache_dtype": a.kv_cache_dtype,
           "matmul_peak_TFLOPs": peak / 1e12, "copy_bandwidth_TBps": bw / 1e12,
           "rows": rows, "machine": machine_info(device)}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    save_json(res, out)


if __name__ == "__main__":
    main()
