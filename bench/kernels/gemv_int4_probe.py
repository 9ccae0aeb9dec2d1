"""Batch-1 GEMV of one Linear shape in every weight format, side by side against the copy
bandwidth measured in the same run: where the INT4 GEMV loses its bytes' worth of time.

  python bench/kernels/gemv_int4_probe.py --out $OUT/gemv-int4-probe-h200.json
  ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight ... \
      python bench/kernels/gemv_int4_probe.py --ncu   # a few plain launches per kernel, no graphs

For each shape (the Llama-3.1-8B projections by default): bf16 (`gemv`), fp8 W8A8 with x
quantized beforehand (`fp8_gemv_a8`, what the norm / SiLU kernels hand it at decode), INT8 and
INT4 group-128 (`int_gemv`), INT4 against int8 x (`int4_gemv_a8`, x rounded beforehand), each
with its tuned launch configuration, timed as bench/kernels/tune_gemv.py times (one CUDA graph of
back-to-back calls over weight copies that L2 cannot hold). Reported: microseconds a call,
weight bytes a call (with scales and zeros), and their rate as a fraction of the copy
bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from skyline.bench.offline import machine_info, save_json
from skyline.ops.fp8_quant import quantize_rows_fp8
from skyline.ops.gemv import gemv
from skyline.ops.gemv_int_a8 import int4_gemv_a8, round_to_int8_chunks
from skyline.ops.gemv_quant import FP8, INT4, INT8, fp8_gemv_a8, int_gemv

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_gemv import ROTATE_BYTES, copy_bandwidth, time_calls  # noqa: E402
from tune_gemv_quant import make_weights  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
GROUP = 128


def formats(n: int, k: int, x: torch.Tensor) -> dict:
    """{name: (bytes a call, [fn over one weight copy each])} with enough copies for L2."""
    xq, xs = quantize_rows_fp8(x)
    out = {}
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    copies = max(1, -(-ROTATE_BYTES // (w.numel() * 2)))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    out["bf16"] = (w.numel() * 2, [lambda w=w: gemv(x, w) for w in ws])
    for name, kind in (("fp8a8q", FP8), ("int8", INT8), ("int4", INT4), ("int4a8", INT4)):
        args, nbytes = make_weights(kind, n, k, GROUP)
        copies = max(1, -(-ROTATE_BYTES // nbytes))
        sets = [args] + [tuple(t.clone() for t in args) for _ in range(copies - 1)]
        if kind == FP8:
            fns = [lambda a=a: fp8_gemv_a8(xq, xs, *a) for a in sets]
        elif name == "int4a8":  # x rounded beforehand, as the norm / SiLU kernels hand it
            xr = round_to_int8_chunks(x)
            fns = [lambda a=a, xr=xr: int4_gemv_a8(xr, *a, GROUP) for a in sets]
        else:
            bits = 4 if kind == INT4 else 8
            fns = [lambda a=a, b=bits: int_gemv(x, *a, b, GROUP) for a in sets]
        out[name] = (nbytes, fns)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ncu", action="store_true",
                    help="launch each kernel a few times without graphs (for ncu) and exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.ncu:
        for shape in args.shapes:
            n, k = SHAPES[shape]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            for name, (_, fns) in formats(n, k, x).items():
                fns[0]()
                torch.cuda.synchronize()
                print(f"ncu launches: {shape} {name}", flush=True)
        return
    bw = copy_bandwidth()
    rows = []
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'shape':8} {'format':7} {'us':>8} {'MB':>7} {'frac':>6}")
    for shape in args.shapes:
        n, k = SHAPES[shape]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for name, (nbytes, fns) in formats(n, k, x).items():
            calls = max(len(fns), 200)
            t = time_calls(fns, calls)
            frac = nbytes / t / bw
            rows.append({"shape": shape, "n": n, "k": k, "format": name, "us": t * 1e6,
                         "bytes": nbytes, "fraction_of_copy_bw": frac})
            print(f"{shape:8} {name:7} {t * 1e6:8.2f} {nbytes / 1e6:7.2f} {frac:6.3f}",
                  flush=True)
            del fns
        torch.cuda.empty_cache()
    if args.out:
        save_json({"machine": machine_info("cuda"), "copy_bandwidth_Bps": bw,
                   "group": GROUP, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
