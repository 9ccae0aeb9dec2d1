"""Batch-1 GEMV of one Linear shape in every weight format, side by side against the copy
bandwidth measured in the same run: where the INT4 GEMV loses its bytes' worth of time.

  python bench/kernels/gemv_int4_probe.py --out $OUT/gemv-int4-probe-h200.json
  ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight ... \
      python bench/kernels/gemv_int4_probe.py --ncu   # a few plain launches per kernel, no graphs
  python bench/kernels/gemv_int4_probe.py --smoke   # seconds, on the CPU (skyline/bench/tuners.py)

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

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.bench.tuners import (  # noqa: E402
    ROTATE_BYTES,
    device_bandwidth,
    random_quant_weights,
    time_calls,
    tune_device,
)
from skyline.ops.fp8_quant import quantize_rows_fp8  # noqa: E402
from skyline.ops.gemv import gemv  # noqa: E402
from skyline.ops.gemv_int_a8 import int4_gemv_a8, round_to_int8_chunks  # noqa: E402
from skyline.ops.gemv_quant import fp8_gemv_a8, int_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
GROUP = 128


def formats(n: int, k: int, x: torch.Tensor, rotate: int) -> dict:
    """{name: (bytes a call, [fn over one weight copy each])}, with copies of the weights
    adding up to `rotate` bytes (so that L2 cannot serve them)."""
    xq, xs = quantize_rows_fp8(x)
    out = {}
    w = torch.randn(n, k, device=x.device, dtype=x.dtype) * 0.02
    copies = max(1, -(-rotate // (w.numel() * 2)))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    out["bf16"] = (w.numel() * 2, [lambda w=w: gemv(x, w) for w in ws])
    for name, fmt in (("fp8a8q", "fp8"), ("int8", "int8"), ("int4", "int4"),
                      ("int4a8", "int4")):
        args, nbytes = random_quant_weights(fmt, n, k, GROUP, x.device)
        copies = max(1, -(-rotate // nbytes))
        sets = [args] + [tuple(t.clone() for t in args) for _ in range(copies - 1)]
        if fmt == "fp8":
            fns = [lambda a=a: fp8_gemv_a8(xq, xs, *a) for a in sets]
        elif name == "int4a8":  # x rounded beforehand, as the norm / SiLU kernels hand it
            xr = round_to_int8_chunks(x)
            fns = [lambda a=a, xr=xr: int4_gemv_a8(xr, *a, GROUP) for a in sets]
        else:
            bits = 4 if fmt == "int4" else 8
            fns = [lambda a=a, b=bits: int_gemv(x, *a, b, GROUP) for a in sets]
        out[name] = (nbytes, fns)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ncu", action="store_true",
                    help="launch each kernel a few times without graphs (for ncu) and exit")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="one tiny shape, on the CPU without a GPU")
    args = ap.parse_args()
    dev = tune_device("gemv_int4_probe", args.smoke)
    torch.manual_seed(0)
    # the interpreter takes fp16 where the GPU runs bf16
    dtype = torch.bfloat16 if dev.device.type == "cuda" else torch.float16
    shapes = {"smoke": (32, 128)} if dev.out_dir else {s: SHAPES[s] for s in args.shapes}
    rotate = 0 if dev.out_dir else ROTATE_BYTES
    if args.ncu:
        for shape, (n, k) in shapes.items():
            x = torch.randn(1, k, device=dev.device, dtype=dtype)
            for name, (_, fns) in formats(n, k, x, rotate).items():
                fns[0]()
                torch.cuda.synchronize()
                print(f"ncu launches: {shape} {name}", flush=True)
        return
    bw = device_bandwidth(dev)
    rows = []
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'shape':8} {'format':7} {'us':>8} {'MB':>7} {'frac':>6}")
    for shape, (n, k) in shapes.items():
        x = torch.randn(1, k, device=dev.device, dtype=dtype)
        for name, (nbytes, fns) in formats(n, k, x, rotate).items():
            calls = 1 if dev.out_dir else max(len(fns), 200)
            t = time_calls(fns, calls)
            frac = nbytes / t / bw
            rows.append({"shape": shape, "n": n, "k": k, "format": name, "us": t * 1e6,
                         "bytes": nbytes, "fraction_of_copy_bw": frac})
            print(f"{shape:8} {name:7} {t * 1e6:8.2f} {nbytes / 1e6:7.2f} {frac:6.3f}",
                  flush=True)
            del fns
        if dev.device.type == "cuda":
            torch.cuda.empty_cache()
    out = dev.path("gemv-int4-probe-smoke.json") if dev.out_dir else args.out
    if out:
        save_json({"machine": machine_info(dev.device.type), "copy_bandwidth_Bps": bw,
                   "group": GROUP, "rows": rows}, out)


if __name__ == "__main__":
    main()
