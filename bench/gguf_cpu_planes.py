"""GGUF layers on the CPU in bfloat16: torch's int4 kernel over one plane (4-bit codes: Q4_1)
or two planes (5- to 8-bit codes: Q5_1, Q5_K, Q8_0, low and high nibbles; skyline/quant/gguf.py)
against the dense bfloat16 weights these types were served with before (and that Q6_K still
is), for the default model's projections and two Llama-8B ones, at decode row counts.
Time per call (median), the ratio to dense, and the resident bits per weight.

  python bench/gguf_cpu_planes.py --threads 2 --out bench/results/cpu/gguf-cpu-planes.json
  python bench/gguf_cpu_planes.py --smoke   # one shape, one and two planes, one row
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from skyline.bench.gguf_blocks import random_blocks
from skyline.bench.offline import machine_info, median_call_s, save_json
from skyline.quant.gguf import GGUFLinearMethod

SHAPES = {"smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
          "llama-8b o": (4096, 4096), "llama-8b down": (4096, 14336)}  # (out, in)
TYPES = {"Q4_1": Q.Q4_1, "Q5_1": Q.Q5_1, "Q5_K": Q.Q5_K, "Q8_0": Q.Q8_0, "Q6_K": Q.Q6_K}


class _Layer(torch.nn.Module):
    def __init__(self, qtype: Q, data: torch.Tensor) -> None:
        super().__init__()
        self.gguf_types = [int(qtype)]
        self.register_buffer("gguf_w0", data)
        self.bias = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="one shape, Q4_1 and Q5_1, one row")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    method = GGUFLinearMethod()
    results = []
    min_s = 0.01 if a.smoke else 0.3
    shapes = {"smollm2 down": SHAPES["smollm2 down"]} if a.smoke else SHAPES
    types = {t: TYPES[t] for t in ("Q4_1", "Q5_1")} if a.smoke else TYPES
    rows = a.rows[:1] if a.smoke else a.rows
    for shape, (n, k) in shapes.items():
        for tname, qtype in types.items():
            if k % GGML_QUANT_SIZES[qtype][0]:
                continue  # rows of K-quants are whole 256-element blocks
            layer = _Layer(qtype, random_blocks(qtype, n, k, n + k, scale=0.01))
            dense = method.dequantized_weight(layer).to(torch.bfloat16)
            x0 = torch.randn(max(rows), k, dtype=torch.bfloat16)
            method.apply(layer, x0[:1])  # builds the packed planes (or dense bf16)
            planes = getattr(layer, "gguf_int4", None)
            held = ([t for p in planes for t in p] if planes is not None
                    else [layer.gguf_dense])
            bits = sum(t.numel() * t.element_size() for t in held) * 8 / (n * k)
            for m in rows:
                x = x0[:m]
                t_dense = median_call_s(lambda x=x, w=dense: F.linear(x, w), min_s)
                t_packed = median_call_s(lambda x=x, lay=layer: method.apply(lay, x), min_s)
                row = {"shape": shape, "N": n, "K": k, "type": tname, "rows": m,
                       "planes": len(planes) if planes is not None else 0,
                       "bits_per_weight": bits, "dense_bf16_us": t_dense * 1e6,
                       "packed_us": t_packed * 1e6, "speedup": t_dense / t_packed}
                results.append(row)
                print(json.dumps(row), flush=True)
    save_json({"benchmark": "gguf_cpu_planes", "threads": a.threads, "torch": torch.__version__,
               "cpu": platform.processor() or platform.machine(), "results": results,
               "machine": machine_info("cpu")}, a.out)


if __name__ == "__main__":
    main()
