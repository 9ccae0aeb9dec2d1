"""FP8 W8A8 Linear against bf16 on one GPU, at the row counts of decode batches and prefill
chunks, for an 8B model's projections: the product alone (`torch._scaled_mm`), the per-token
activation quantization (reference and Triton kernel), and the whole fp8 Linear as the engine
runs it, each against bf16 `F.linear`; with the matmul peak measured in the same run. GPU
time per call, from CUDA graphs (host launch overheads excluded, as in the engine's decode).

  python bench/fp8_linear_speed.py --out bench/results/kernels/fp8-linear-h200.json
  python bench/fp8_linear_speed.py --smoke   # one small shape on the CPU: the code, no figures
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from skyline.bench.tuners import time_calls, tune_device  # noqa: E402
from skyline.ops.fp8_quant import quantize_rows_fp8_ref, quantize_rows_fp8_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # Llama-3.1-8B: (out, in)
ROWS = (64, 256, 512, 1024, 8192)


def timed(fn, reps: int = 10) -> float:
    """Median GPU seconds of one `fn` call: `reps` calls captured in a CUDA graph (as the
    engine's decode steps run, so host launch costs stay out), replayed 20 times."""
    return time_calls([fn], reps, replays=20)


def measure(w: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, act: torch.Tensor,
            reps: int = 10) -> dict[str, float]:
    """Seconds of each variant for activations `act` [m, k] and weight w [n, k] (bf16) or
    its e4m3 rows wq with scales ws [1, n]."""
    xq, xs = quantize_rows_fp8_triton(act)

    def fp8_linear(quant):
        q, s = quant(act)
        return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16)

    return {
        "bf16": timed(reps=reps, fn=lambda: F.linear(act, w)),
        "fp8_mm": timed(reps=reps, fn=lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                 out_dtype=torch.bfloat16)),
        "quant_ref": timed(reps=reps, fn=lambda: quantize_rows_fp8_ref(act)),
        "quant_triton": timed(reps=reps, fn=lambda: quantize_rows_fp8_triton(act)),
        "fp8_linear_ref": timed(reps=reps, fn=lambda: fp8_linear(quantize_rows_fp8_ref)),
        "fp8_linear": timed(reps=reps, fn=lambda: fp8_linear(quantize_rows_fp8_triton)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="one small shape; without a GPU, on the CPU in Triton's interpreter")
    a = ap.parse_args()
    dev = tune_device("fp8_linear_speed", a.smoke).device
    if dev.type != "cuda":
        print("fp8_linear_speed --smoke: no GPU, so no fp8 tensor cores: the products run "
              "where torch runs them on the CPU; the figures mean nothing", flush=True)
    side = 256 if a.smoke else 8192
    x = torch.randn(side, side, device=dev, dtype=torch.bfloat16)
    peak = 2 * side**3 / timed(lambda: x @ x)
    rows = []
    shapes = {"smoke": (64, 128)} if a.smoke else SHAPES
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_rows_fp8_ref(w)
        ws = ws.reshape(1, -1)
        for m in (4,) if a.smoke else ROWS:
            act = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t = measure(w, wq, ws, act, reps=1 if a.smoke else 10)
            row = {"proj": name, "n": n, "k": k, "rows": m, **{f"{k_}_us": v * 1e6
                                                                for k_, v in t.items()},
                   "bf16_tflops": 2 * m * n * k / t["bf16"] / 1e12,
                   "speedup_fp8_linear": t["bf16"] / t["fp8_linear"],
                   "speedup_fp8_linear_ref": t["bf16"] / t["fp8_linear_ref"]}
            rows.append(row)
            print(f"{name:8s} m={m:5d} bf16 {row['bf16_us']:8.1f} us  fp8 mm "
                  f"{row['fp8_mm_us']:8.1f}  quant ref {row['quant_ref_us']:7.1f} triton "
                  f"{row['quant_triton_us']:6.1f}  fp8 linear {row['fp8_linear_us']:8.1f} "
                  f"({row['speedup_fp8_linear']:.2f}x; with ref quant "
                  f"{row['speedup_fp8_linear_ref']:.2f}x)", flush=True)
    res = {"benchmark": "fp8 W8A8 Linear vs bf16",
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "bf16_matmul_peak_tflops": peak / 1e12, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
