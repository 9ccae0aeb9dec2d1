"""Top-p draws on this GPU: the sort-free nucleus kernel (ops/nucleus.py) against the sorting
reference it replaces, at decode batch sizes over a Llama-3 and a Qwen3 vocabulary, for a
peaked row (logits ~ N(0, 4^2): the nucleus holds tens of tokens) and a flat one (N(0, 1): it
holds most of the vocabulary, and the kernel's first race mostly lands past it). The floor is
one read of the logits and the noise at the copy bandwidth measured in the same run; each case
also checks that the kernel drew the reference's tokens.

  python bench/kernels/nucleus_speed.py --out bench/results/kernels/nucleus-h200.json
  python bench/kernels/nucleus_speed.py --smoke    # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench import tuners  # noqa: E402
from skyline.bench.floor import median_seconds  # noqa: E402
from skyline.ops.nucleus import nucleus_draw_ref, nucleus_draw_triton  # noqa: E402

VOCABS = {"llama-3.1-8b": 128256, "qwen3-8b": 151936}
SIGMAS = {"peaked": 4.0, "flat": 1.0}
SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16), (8192, 8), (8192, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--vocabs", nargs="+", default=list(VOCABS), choices=list(VOCABS))
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the kernel's (block, warps) choices at 256 and 1,024 rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    args = ap.parse_args()
    dev = tuners.tune_device("nucleus_speed.py", args.smoke)
    vocabs = {name: VOCABS[name] for name in args.vocabs}
    if args.smoke:
        args.rows, args.reps, vocabs = [2], 2, {"tiny": 5000}
    bw = tuners.device_bandwidth(dev)
    gen = torch.Generator(device=dev.device).manual_seed(0)
    cases = []
    for name, vocab in vocabs.items():
        for rows in args.rows:
            for shape, sigma in SIGMAS.items():
                logits = torch.randn(rows, vocab, device=dev.device, generator=gen) * sigma
                noise = torch.empty_like(logits).exponential_(generator=gen)
                top_p = torch.full((rows,), args.top_p, device=dev.device)
                call = (logits, top_p, noise)
                same = torch.equal(nucleus_draw_triton(*call), nucleus_draw_ref(*call))
                kernel = median_seconds(lambda c=call: nucleus_draw_triton(*c), dev.device,
                                        args.reps)
                ref = median_seconds(lambda c=call: nucleus_draw_ref(*c), dev.device, args.reps)
                floor = 2 * logits.numel() * 4 / bw
                cases.append({"vocab": name, "vocab_size": vocab, "rows": rows, "shape": shape,
                              "sigma": sigma, "top_p": args.top_p, "kernel_s": kernel,
                              "sort_s": ref, "floor_s": floor, "speedup": ref / kernel,
                              "kernel_passes": kernel / floor * 2, "same_tokens": same})
                print(f"{name:>13} {rows:5d} rows {shape:>6}: kernel {kernel * 1e6:8.1f} us, "
                      f"sort {ref * 1e6:8.1f} us ({ref / kernel:5.1f}x), floor "
                      f"{floor * 1e6:7.1f} us ({kernel / floor:4.1f}x), same tokens {same}",
                      flush=True)
    sweep = []
    if args.sweep:
        vocab = next(iter(vocabs.values()))
        for rows in ([2] if args.smoke else [256, 1024]):
            logits = torch.randn(rows, vocab, device=dev.device, generator=gen) * 4.0
            noise = torch.empty_like(logits).exponential_(generator=gen)
            top_p = torch.full((rows,), args.top_p, device=dev.device)
            for block, warps in SWEEP:
                t = median_seconds(lambda b=block, w=warps, c=(logits, top_p, noise):
                                   nucleus_draw_triton(*c, block=b, num_warps=w),
                                   dev.device, args.reps)
                sweep.append({"rows": rows, "block": block, "num_warps": warps, "kernel_s": t})
                print(f"sweep {rows:5d} rows block {block:5d} warps {warps:2d}: "
                      f"{t * 1e6:8.1f} us", flush=True)
    result = {"benchmark": "nucleus_speed",
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": dev.name, "torch": torch.__version__,
              "command": "python bench/kernels/nucleus_speed.py " + " ".join(sys.argv[1:]),
              "copy_bandwidth_Bps": bw, "cases": cases, "sweep": sweep}
    if not all(c["same_tokens"] for c in cases):
        print("the kernel drew other tokens than the reference in some case", flush=True)
    out = dev.path("bench/results/kernels/nucleus-h200.json", args.out)
    if args.out or args.smoke:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
