"""Decode GEMVs of block-scaled weights read at their own bits (ops/gemv_block.py: NVFP4, MXFP4,
GGUF Q6_K and Q5_K) against the copy bandwidth measured in the same run and against the paths they
replace, at Llama-3.1-8B's Linear shapes and 1, 2, 4 rows of x.

  python bench/kernels/gemv_fp4_gguf_speed.py --out $OUT/gemv-fp4-gguf-h200.json
  python bench/kernels/gemv_fp4_gguf_speed.py --sweep --out $OUT/gemv-fp4-gguf-sweep-h200.json
  python bench/kernels/gemv_fp4_gguf_speed.py --smoke   # seconds, on the CPU (interpreter)

Formats (bf16 x), each timed as bench/kernels/tune_gemv.py times (one CUDA graph of
back-to-back calls over weight copies that L2 cannot hold):
- bf16: the dense GEMV (ops/gemv.py), for scale;
- nvfp4: the block GEMV on the packed tensors (4.5 bits a weight); nvfp4_dequant: what
  Nvfp4LinearMethod ran on CUDA before, the whole weight dequantized at every call, then
  F.linear;
- mxfp4: the block GEMV on the packed tensors (4.25 bits a weight); mxfp4_int8: what
  Mxfp4LinearMethod ran on CUDA before, the codes as exact 8-bit codes 128 + 2v with half the
  E8M0 scale per 32 (ops/gemv_quant.int_gemv; 9.25 bits a weight);
- q6_k / q5_k: the block GEMV on the raw super-blocks (6.56 / 5.5 bits); q6_k_int8 /
  q5_k_int8: what a GGUF layer ran before, the blocks as 8-bit codes with float32 scale and zero
  per 16 / 32 (ops/gemv_quant.int_gemv; 12 / 10 bits a weight);
- past 8 rows (--rows 16 32 64), what ran there before the GEMV took up to 64 rows:
  <format>_scratch, the weights dequantized by the Triton dequantizer into the scratch buffer
  (32 MiB of rows at a time) and multiplied by cuBLAS;
- up to 4 rows, nvfp4_dot / mxfp4_dot / q6_k_dot / q5_k_dot: the block GEMV's tensor-core mode
  (x as it is, the weight tile rounded for the MMA), beside the integer mode (x rounded to int8,
  `dp4a`) that is the default there (Q6_K: up to 2 rows).
Reported per shape, rows and format: microseconds a call, bytes a call (weights with their
scales), the rate as a fraction of the copy bandwidth (the roofline of its own bytes), and the
speedup over the path it replaces. With --sweep, each new GEMV is also timed over the launch
configurations `skyline tune` tries (skyline/tune/gemv_block.py's candidates in --modes, each
checked against the reference first) and the fastest is reported beside the default's time:
the data for a tuning table ("gemv_nvfp4", "gemv_mxfp4", "gemv_q6_k", "gemv_q5_k", keys
"<N>x<K>:m<rows>").
"""

from __future__ import annotations

import argparse
import sys
import time

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from skyline.bench.gguf_blocks import random_blocks  # noqa: E402
from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.bench.tuners import (  # noqa: E402
    ROTATE_BYTES,
    device_bandwidth,
    time_calls,
    tune_device,
)
from skyline.ops.block_linear import (  # noqa: E402
    SCRATCH_BYTES,
    chunked_linear,
    gguf_dequantize,
    mxfp4_dequantize,
    nvfp4_dequantize,
)
from skyline.ops.fp4 import (  # noqa: E402
    decode_e2m1,
    dequantize_nvfp4,
    e8m0_to_float,
    unpack_nibbles,
)
from skyline.ops.gemv import gemv  # noqa: E402
from skyline.ops.gemv_block import (  # noqa: E402
    MXFP4,
    NVFP4,
    Q5_K,
    Q6_K,
    block_gemv_config,
    default_config,
    gguf_gemv,
    mxfp4_gemv,
    nvfp4_gemv,
)
from skyline.ops.gemv_quant import int_gemv  # noqa: E402
from skyline.quant.fp4 import quantize_mxfp4, quantize_nvfp4  # noqa: E402
from skyline.quant.gguf_cuda import int_layout_runs  # noqa: E402
from skyline.tune import gemv_block as block_tuner  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = (1, 2, 4)
REPLACES = {"nvfp4": "nvfp4_dequant", "mxfp4": "mxfp4_int8", "q6_k": "q6_k_int8",
            "q5_k": "q5_k_int8"}
DOT_ROWS = 4  # the tensor-core mode is timed beside the default up to this many rows


def nbytes(ts: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def copies(args: tuple[torch.Tensor, ...], rotate: int) -> list[tuple[torch.Tensor, ...]]:
    """args and clones of it adding up to `rotate` bytes (L2 cannot serve them)."""
    n = max(1, -(-rotate // nbytes(args)))
    return [args] + [tuple(t.clone() for t in args) for _ in range(n - 1)]


def weights(n: int, k: int, dev: torch.device) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each format's tensors of one random [n, k] weight."""
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    w = torch.randn(n, k, device=dev) * 0.02
    out["bf16"] = (w.to(torch.bfloat16),)
    q, s, ts = quantize_nvfp4(w)
    out["nvfp4"] = (q, s, ts.expand(n).contiguous())
    q, s = quantize_mxfp4(w)
    out["mxfp4"] = (q, s)
    scale = e8m0_to_float(s) / 2
    out["mxfp4_int8"] = ((128 + 2 * decode_e2m1(unpack_nibbles(q))).to(torch.uint8), scale,
                         torch.full_like(scale, 128.0), torch.tensor(32))
    del w
    for name, qtype in (("q6_k", Q.Q6_K), ("q5_k", Q.Q5_K)):
        data = random_blocks(qtype, n, k, seed=n + k, scale=1e-3).to(dev)
        out[name] = (data,)
        codes, scales, zeros, _, group = int_layout_runs([(data, int(qtype))])
        out[f"{name}_int8"] = (codes, scales, zeros, torch.tensor(group))
    return out


FMT_IDS = {"nvfp4": NVFP4, "mxfp4": MXFP4, "q6_k": Q6_K, "q5_k": Q5_K}


def num_sms(x: torch.Tensor) -> int:
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132


def dot_config(fmt: str, x: torch.Tensor, a: tuple[torch.Tensor, ...]) -> dict:
    """The tensor-core mode's configuration (default_config's, above four rows)."""
    return default_config(FMT_IDS[fmt], 8, a[0].shape[0], x.shape[-1], num_sms(x))


def call(fmt: str, x: torch.Tensor, a: tuple[torch.Tensor, ...], config: dict | None = None):
    if fmt.endswith("_dot"):
        base = fmt[: -len("_dot")]
        return call(base, x, a, dot_config(base, x, a))
    if fmt == "bf16":
        if x.shape[0] <= 8:
            return lambda: gemv(x, a[0])
        w = a[0].to(x.dtype)  # the same tensor on the GPU (bf16); the smoke's x is fp16
        return lambda: F.linear(x, w)
    if fmt.endswith("_scratch"):
        return lambda: chunked_linear(x, a[0].shape[0], None, scratch_dequantizer(fmt, a),
                                       SCRATCH_BYTES)
    if fmt == "nvfp4":
        return lambda: nvfp4_gemv(x, *a, config=config)
    if fmt == "mxfp4":
        return lambda: mxfp4_gemv(x, *a, config=config)
    if fmt == "nvfp4_dequant":
        k = x.shape[-1]
        return lambda: F.linear(x, dequantize_nvfp4(*a)[:, :k].to(x.dtype))
    if fmt in ("q6_k", "q5_k"):
        qtype = Q.Q6_K if fmt == "q6_k" else Q.Q5_K
        return lambda: gguf_gemv(x, a[0], qtype, config=config)
    group = int(a[3])
    return lambda: int_gemv(x, a[0], a[1], a[2], 8, group)


def scratch_dequantizer(fmt: str, a: tuple[torch.Tensor, ...]):
    """dequantize(start, stop, out) of rows [start, stop) of the stored tensors `a`."""
    base = fmt[: -len("_scratch")]
    if base == "nvfp4":
        return lambda i, j, out: nvfp4_dequantize(a[0][i:j], a[1][i:j], a[2][i:j], out)
    if base == "mxfp4":
        return lambda i, j, out: mxfp4_dequantize(a[0][i:j], a[1][i:j], out)
    qtype = Q.Q6_K if base == "q6_k" else Q.Q5_K
    return lambda i, j, out: gguf_dequantize(a[0][i:j], qtype, out)


def grid(fmt: str, x: torch.Tensor, n: int, modes: list[str]) -> list[dict]:
    """The launch configurations --sweep tries: `skyline tune`'s candidates in the given
    modes."""
    cands = block_tuner.candidates(FMT_IDS[fmt], x.shape[0], n, x.shape[-1], num_sms(x))
    return [c for c in cands if ("a8" if c["A8"] else "dot") in modes]


def sweep(fmt: str, x: torch.Tensor, sets: list[tuple[torch.Tensor, ...]], calls: int,
          deadline: float, modes: list[str]) -> dict:
    """The fastest configuration of the grid that matches the reference, and its time."""
    a = sets[0]
    refs = {a8: block_tuner.reference(FMT_IDS[fmt], x, a, a8).float() for a8 in (False, True)}
    best: dict = {"config": None, "us": float("inf"), "tried": 0, "failed": 0}
    for cfg in grid(fmt, x, a[0].shape[0], modes):
        if time.monotonic() > deadline:
            best["budget"] = True
            break
        best["tried"] += 1
        ref = refs[cfg["A8"]]
        tol = 2e-2 * ref.abs().max().item()
        try:
            got = call(fmt, x, a, cfg)().float()
            if not torch.allclose(got, ref, rtol=2e-2, atol=tol):
                raise ValueError("does not match the reference")
            t = time_calls([call(fmt, x, s, cfg) for s in sets], calls)
        except Exception:  # a configuration that cannot compile or run is skipped
            best["failed"] += 1
            continue
        if t * 1e6 < best["us"]:
            best.update(config=cfg, us=t * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="also time a grid of launch configurations per new GEMV")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="--sweep's time, shared evenly by every shape, rows and format")
    ap.add_argument("--modes", nargs="+", default=["a8", "dot"], choices=["a8", "dot"],
                    help="the modes --sweep tries")
    ap.add_argument("--formats", nargs="+", default=list(FMT_IDS), choices=list(FMT_IDS),
                    help="the block formats timed (each with the paths it replaced; bf16 always)")
    ap.add_argument("--smoke", action="store_true",
                    help="one tiny shape, on the CPU without a GPU")
    args = ap.parse_args()
    dev = tune_device("gemv_fp4_gguf_speed", args.smoke)
    torch.manual_seed(0)
    # the interpreter takes fp16 where the GPU runs bf16
    dtype = torch.bfloat16 if dev.device.type == "cuda" else torch.float16
    shapes = {"smoke": (24, 512)} if dev.out_dir else {s: SHAPES[s] for s in args.shapes}
    rows_list = [1, 12] if dev.out_dir else args.rows
    rotate = 0 if dev.out_dir else ROTATE_BYTES
    bw = device_bandwidth(dev)
    rows = []
    per_sweep = args.budget_s / (len(shapes) * len(rows_list) * len(args.formats))
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'shape':8} {'m':>2} {'format':14} {'us':>8} {'MB':>7} {'frac':>6} {'speedup':>7}")
    for shape, (n, k) in shapes.items():
        formats = weights(n, k, dev.device)
        for m in rows_list:
            x = torch.randn(m, k, device=dev.device, dtype=dtype)
            times, entries = {}, []
            fmts = ["bf16"]
            for f in args.formats:
                old = REPLACES[f] if m <= 8 else f"{f}_scratch"
                fmts += [f, old] + ([f"{f}_dot"] if m <= DOT_ROWS else [])
            for fmt in fmts:
                stored = formats[fmt.rsplit("_", 1)[0]
                                 if fmt.endswith(("_dequant", "_dot", "_scratch")) else fmt]
                size = nbytes(stored[:3])
                sets = copies(stored, rotate)
                fns = [call(fmt, x, a) for a in sets]
                calls = 1 if dev.out_dir else max(len(fns), 20 if "dequant" in fmt else 200)
                t = times[fmt] = time_calls(fns, calls)
                entries.append({"shape": shape, "n": n, "k": k, "m": m, "format": fmt,
                                "config": (dot_config(fmt[:-4], x, stored)
                                           if fmt.endswith("_dot") else
                                           block_gemv_config(FMT_IDS[fmt], m, n, k, x.device)
                                           if fmt in FMT_IDS else None),
                                "us": t * 1e6, "bytes": size,
                                "bits_per_weight": size * 8 / n / k,
                                "fraction_of_copy_bw": size / t / bw,
                                "replaces": (REPLACES.get(fmt) if m <= 8 or fmt not in FMT_IDS
                                             else f"{fmt}_scratch"),
                                "speedup_vs_replaced": None})
                if args.sweep and fmt in FMT_IDS:
                    best = sweep(fmt, x, sets, calls, time.monotonic() + per_sweep,
                                 args.modes)
                    best["default"] = block_gemv_config(FMT_IDS[fmt], m, n, k, x.device)
                    if best["config"] is None:  # none ran
                        best.update(us=None, fraction_of_copy_bw=None)
                    else:
                        best["fraction_of_copy_bw"] = size / (best["us"] * 1e-6) / bw
                    entries[-1]["sweep"] = best
                    print(f"  sweep {fmt} m{m}: best {best['us']} us "
                          f"({best['fraction_of_copy_bw']}) {best['config']}", flush=True)
                del fns, sets
            for e in entries:
                if e["replaces"]:
                    e["speedup_vs_replaced"] = times[e["replaces"]] / times[e["format"]]
                if f"{e['format']}_dot" in times:
                    e["speedup_vs_dot"] = times[f"{e['format']}_dot"] / times[e["format"]]
                speedup = e["speedup_vs_replaced"]
                print(f"{shape:8} {m:2} {e['format']:14} {e['us']:8.2f} {e['bytes'] / 1e6:7.2f} "
                      f"{e['fraction_of_copy_bw']:6.3f} "
                      f"{'' if speedup is None else f'{speedup:7.2f}'}", flush=True)
            rows.extend(entries)
        del formats
        if dev.device.type == "cuda":
            torch.cuda.empty_cache()
    out = dev.path("gemv-fp4-gguf-smoke.json") if dev.out_dir else args.out
    if out:
        save_json({"machine": machine_info(dev.device.type), "copy_bandwidth_Bps": bw,
                   "rows": rows}, out)


if __name__ == "__main__":
    main()
