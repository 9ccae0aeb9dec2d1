"""CPU Linear products: `F.linear` (float32: MKL, which repacks the weight on every call;
bfloat16: oneDNN without a prepacked weight) against oneDNN with the weight packed once
(`skyline/ops/cpu_linear.py`), for the default model's projections and LM head, at the row
counts of decode steps, verification steps and prefill chunks; float32 and bfloat16. Also the
weight read rate of the packed product (bytes / time) and whether row results depend on the
batch (batch invariance).

  python bench/cpu_linear_speed.py --threads 2 --out bench/results/cpu/cpu-linear-onednn.json
  python bench/cpu_linear_speed.py --smoke   # one dtype and projection, two row counts
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from skyline.bench.offline import median_call_s
from skyline.ops import cpu_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # SmolLM2-135M: (out, in)
ROWS = (1, 2, 4, 8, 9, 16, 64, 512)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="one dtype and projection, two row counts")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    min_s = 0.01 if a.smoke else 0.3
    row_counts = ROWS[:1] + ROWS[3:4] if a.smoke else ROWS
    for dtype in (torch.float32,) if a.smoke else (torch.float32, torch.bfloat16):
        for name, (n, k) in list(SHAPES.items())[:1] if a.smoke else SHAPES.items():
            g = torch.Generator().manual_seed(n + k)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            packed = cpu_linear.pack(w)
            x_all = torch.randn(max(row_counts), k, generator=g).to(dtype)
            full = cpu_linear.packed_linear(x_all, packed)
            full_ref = F.linear(x_all, w)
            for m in row_counts:
                x = x_all[:m]
                t_ref = median_call_s(lambda x=x, w=w: F.linear(x, w), min_s)
                t_dnn = median_call_s(lambda x=x, p=packed: cpu_linear.packed_linear(x, p), min_s)
                row = {"dtype": str(dtype).removeprefix("torch."), "proj": name, "n": n, "k": k,
                       "rows": m, "f_linear_us": t_ref * 1e6, "onednn_packed_us": t_dnn * 1e6,
                       "speedup": t_ref / t_dnn,
                       "weight_gb_s_packed": n * k * w.element_size() / t_dnn / 1e9,
                       "batch_invariant_packed": bool(torch.equal(
                           cpu_linear.packed_linear(x, packed), full[:m])),
                       "batch_invariant_f_linear": bool(torch.equal(F.linear(x, w), full_ref[:m]))}
                rows.append(row)
                print(f"{row['dtype']:8s} {name:8s} rows {m:4d}: "
                      f"F.linear {row['f_linear_us']:9.1f} us  "
                      f"oneDNN packed {row['onednn_packed_us']:9.1f} us  "
                      f"{row['speedup']:5.2f}x  ({row['weight_gb_s_packed']:5.1f} GB/s)  "
                      f"invariant packed/F.linear {row['batch_invariant_packed']}/"
                      f"{row['batch_invariant_f_linear']}", flush=True)
    res = {"benchmark": "CPU Linear: F.linear vs oneDNN with prepacked weights",
           "machine": f"{platform.machine()} {torch.get_num_threads()} threads, "
                      f"{platform.platform()}",
           "torch": torch.__version__, "threads": a.threads,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
