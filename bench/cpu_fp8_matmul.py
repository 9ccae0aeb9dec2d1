"""FP8 W8A8 products on the CPU, for the default model's projections at decode row counts:
torch's `_scaled_mm` on the CPU, the float32 emulation of ops/fp8_linear.py (both sides
dequantized at every call), and the weight dequantized once into bf16 and packed for oneDNN
with the activations still quantized per row (what a CPU engine serves since quant/fp8.py's
prepack_cpu). Median milliseconds per product.

  python bench/cpu_fp8_matmul.py --threads 2 --out bench/results/cpu/cpu-fp8-matmul.json
  python bench/cpu_fp8_matmul.py --smoke   # one shape and row count, a few calls
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from skyline.bench.offline import median_call_s, save_json
from skyline.ops import cpu_linear
from skyline.ops.fp8_quant import fake_quantize_rows_fp8, quantize_rows_fp8

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # SmolLM2-135M
ROWS = (1, 8)


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x times a bf16 weight, packed for oneDNN (cpu_linear.pack) or plain."""
    return cpu_linear.packed_linear(x, w) if w.is_mkldnn else F.linear(x, w)


def products(wq: torch.Tensor, w_scale: torch.Tensor, packed: torch.Tensor,
             x: torch.Tensor) -> dict:
    """The three ways to the same W8A8 product, as zero-argument calls."""
    xq, x_scale = quantize_rows_fp8(x)
    return {
        "scaled_mm": lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_scale,
                                              scale_b=w_scale[None, :], out_dtype=torch.bfloat16),
        "emulation": lambda: F.linear(xq.float() * x_scale, wq.float() * w_scale[:, None]),
        "dense_once": lambda: dense_linear(fake_quantize_rows_fp8(x).to(torch.bfloat16),
                                           packed),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="one shape and row count")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    min_s = 0.01 if a.smoke else 0.3
    for name, (n, k) in list(SHAPES.items())[:1] if a.smoke else SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        wq, w_scale = quantize_rows_fp8(torch.randn(n, k, generator=g) * 0.05)
        w_scale = w_scale.reshape(-1)
        dense = (wq.float() * w_scale[:, None]).to(torch.bfloat16)
        # oneDNN's packed bf16 where this CPU has bf16 instructions, else the plain weight
        packed = cpu_linear.pack(dense) if cpu_linear.can_pack(dense) else dense
        for m in ROWS[:1] if a.smoke else ROWS:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            fns = products(wq, w_scale, packed, x)
            row = {"shape": name, "n": n, "k": k, "rows": m}
            for label, fn in fns.items():
                try:
                    row[f"{label}_ms"] = median_call_s(fn, min_s) * 1e3
                except RuntimeError as e:  # a torch without the CPU fp8 matmul
                    row[f"{label}_ms"] = None
                    row[f"{label}_error"] = str(e).splitlines()[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
    save_json({"benchmark": "cpu_fp8_matmul", "date": time.strftime("%Y-%m-%d"),
               "machine": platform.processor() or platform.machine(), "threads": a.threads,
               "torch": torch.__version__, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
