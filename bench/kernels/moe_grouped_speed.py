"""The MoE MLP at prefill and large-batch sizes on this GPU: ops/moe.py's grouped GEMMs
(fused_moe_triton: the pairs sorted by expert, the gate/up GEMM, the activation, the down GEMM
with the routing weights, the top-k sum) for gpt-oss-20b's experts in MXFP4, the same shape in
bf16 (what the 4-bit format should at least match once the product is compute-bound) and
Qwen3-30B-A3B's in bf16, at 256, 1,024 and 4,096 tokens: time per call against the floor of
the call, the larger of its FLOPs over the bf16 matmul peak and the distinct experts' bytes
over the copy bandwidth, both measured in the same run. MXFP4 rows time the kernel decoding
each weight tile in registers ("ms") and the layer's experts decoded to bf16 first, then the
dense kernel ("decoded_ms": what fused_moe_triton runs from moe.DECODE_PAIRS pairs up), and
each MXFP4 case the decoding alone against the copy rate.

With --tune, candidate launch configurations (rows, columns and K per tile, warps, pipeline
stages) are checked against the reference and timed, and the fastest written to the tuning
table (skyline/ops/configs/moe-<gpu>.json, kernel "fused_moe", keyed by the gate/up shape, the
format, the dtype and the pair count's bucket).

  python bench/kernels/moe_grouped_speed.py --out bench/results/kernels/moe-grouped-h200.json
  python bench/kernels/moe_grouped_speed.py --tune --budget-s 300
  python bench/kernels/moe_grouped_speed.py --smoke      # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

# this script's folder is on sys.path: the decode GEMVs' script's shapes, experts and timing
from moe_gemv_speed import SHAPES, expert_bytes, fastest, make, time_op  # noqa: E402

from skyline.bench import tuners  # noqa: E402
from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.ops.moe import (  # noqa: E402
    DECODE_BLOCK,
    KERNEL,
    decoded_experts,
    fused_moe_ref,
    fused_moe_triton,
    moe_config,
)
from skyline.ops.tuning import CONFIG_DIR, dtype_name, token_bucket, write_configs  # noqa: E402

# The decoding kernel's (rows, columns, warps) per program timed; the default first.
DECODE_BLOCKS = (DECODE_BLOCK, (16, 512, 4), (16, 1024, 8), (32, 512, 8), (8, 512, 4),
                 (32, 128, 4), (32, 256, 4))
CASES = (("gpt-oss-20b", "mxfp4"), ("gpt-oss-20b", "dense"), ("qwen3-30b-a3b", "dense"))


def candidates(base: dict[str, Any], smoke: bool) -> list[dict[str, Any]]:
    """The current configuration first, then tiles of 32-128 rows, 64-128 columns and K tiles
    of 64-128, 4 or 8 warps, 2-4 stages (two in all for a smoke run)."""
    out = [base]
    for bm, bn, bk, warps, stages in itertools.product(
            (64, 128, 32, 16), (128, 64), (64, 128), (4, 8), (3, 2, 4)):
        cfg = {**base, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
               "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    return out[:2] if smoke else out


def in_tiles(*args: Any, **kw: Any) -> torch.Tensor:
    """The grouped GEMMs with MXFP4 tiles decoded inside the kernel at every pair count."""
    return fused_moe_triton(*args, decode=False, **kw)


def decoded_first(*args: Any) -> torch.Tensor:
    """The layer's MXFP4 experts decoded to bf16 first, then the dense grouped GEMMs."""
    return fused_moe_triton(*args, decode=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON report (written after every row)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--cases", nargs="+", default=[f"{m}:{f}" for m, f in CASES],
                    help="model:format pairs")
    ap.add_argument("--tune", action="store_true", help="time candidates, write the table")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="--tune: seconds in all, shared by the cases and token counts")
    ap.add_argument("--configs-out", default=None,
                    help="tuning table (default skyline/ops/configs/moe-<gpu>.json)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from skyline.bench.floor import matmul_peak
    from skyline.ops.triton_utils import triton

    if triton is None:
        print("skipped: the MoE kernels need triton (on the CPU for Triton's interpreter)")
        return
    dev = tuners.tune_device("moe_grouped_speed", a.smoke)
    device, smoke = dev.device, dev.device.type != "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    copy_bw = tuners.device_bandwidth(dev)
    peak = matmul_peak(device)
    print(f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s, copy {copy_bw / 1e12:.2f} TB/s")
    res: dict[str, Any] = {
        "benchmark": "moe_grouped_speed", "device": dev.name, "machine": machine_info(
            device.type), "command": "python " + " ".join(sys.argv),
        "peak_TFLOPs": peak / 1e12, "copy_bandwidth_TBps": copy_bw / 1e12, "rows": []}
    table: dict[str, Any] = {}
    cases = [tuple(c.split(":")) for c in a.cases][:2 if smoke else None]
    for model, fmt in cases:
        e, h, i, k, act, bias = SHAPES[model]
        if smoke:
            e, h, i = 8, 64, 32
        w13, w2 = make(e, h, i, fmt, bias, device, dtype)
        pair = (w13, w2)
        per_expert = expert_bytes(w13, w2)
        limit = 7.0 if act == "swiglu_oai" else None
        if fmt == "mxfp4":  # the decoding alone, per (rows, columns, warps) of a program
            # codes and scales read, two values a byte written
            moved = sum(w.weight.nbytes + w.scale.nbytes + 2 * w.weight.numel() * dtype.itemsize
                        for w in pair)
            for block in DECODE_BLOCKS[:1 if smoke else None]:
                ds = tuners.time_calls(
                    [lambda p=pair, b=block: [decoded_experts(w, dtype, b) for w in p]],
                    1 if smoke else 4)
                res.setdefault("decoding", []).append({
                    "model": model, "block": block, "ms": ds * 1e3, "bytes": moved,
                    "floor_ms": moved / copy_bw * 1e3, "fraction_of_floor": moved / copy_bw / ds})
                print(f"{model:14} decoding the layer's experts, {block}: {ds * 1e3:.3f} ms "
                      f"({moved / copy_bw / ds:.2f} of the copy rate)")
        for t in ((16,) if smoke else a.tokens):
            g = torch.Generator().manual_seed(t)
            routes = [torch.topk(torch.randn(t, e, generator=g).softmax(-1), k) for _ in range(2)]
            routes = [(w.to(device), ids.to(device)) for w, ids in routes]
            x = torch.randn(t, h, device=device, dtype=dtype)
            distinct = sum(r[1].unique().numel() for r in routes) / len(routes)
            flops = 6 * t * k * h * i
            floor_s = max(flops / peak, distinct * per_expert / copy_bw)
            want = fused_moe_ref(x, w13, w2, *routes[0], act, limit).float()
            case = (x, w13, w2, routes, act, limit, 1 if smoke else 4)

            config = moe_config(t * k, w13, dtype)
            s = time_op(in_tiles, *case)
            row: dict[str, Any] = {
                "model": model, "fmt": fmt, "tokens": t, "pairs": t * k, "config": config,
                "ms": s * 1e3, "TFLOPs": flops / s / 1e12, "floor_ms": floor_s * 1e3,
                "fraction_of_floor": floor_s / s}
            if fmt == "mxfp4":  # decoded first, then the dense kernel (its own configuration)
                got = decoded_first(x, w13, w2, *routes[0], act, limit).float()
                ds = time_op(decoded_first, *case)
                row |= {"decoded_ms": ds * 1e3,
                        "decoded_rel_error": ((got - want).norm() / want.norm()).item(),
                        "decoded_fraction_of_floor": floor_s / ds, "decoded_speedup": s / ds}
            if a.tune:  # each (case, token count) its share of the budget
                tokens = 1 if smoke else len(a.tokens)
                deadline = time.time() + a.budget_s / (len(cases) * tokens)
                options = ((cfg, {"config": cfg}) for cfg in candidates(config, smoke))
                best_s, best = fastest(in_tiles, case, want, options, deadline)
                key = f"n{w13.n}:k{w13.k}:{fmt}:{dtype_name(dtype)}:t{token_bucket(t * k)}"
                table[key] = best
                row |= {"tuned": best, "tuned_ms": best_s * 1e3,
                        "tuned_TFLOPs": flops / best_s / 1e12,
                        "tuned_fraction_of_floor": floor_s / best_s}
            res["rows"].append(row)
            tuned = (f", tuned {row['tuned_ms']:.3f} ms ({row['tuned_fraction_of_floor']:.2f})"
                     if "tuned_ms" in row else "")
            if "decoded_ms" in row:
                tuned += (f", decoded first {row['decoded_ms']:.3f} ms "
                          f"({row['decoded_speedup']:.2f}x)")
            print(f"{model:14} {fmt:6} T={t:5}: {row['ms']:8.3f} ms, {row['TFLOPs']:6.1f} "
                  f"TFLOP/s, floor {row['floor_ms']:.3f} ms ({row['fraction_of_floor']:.2f})"
                  f"{tuned}", flush=True)
            res["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
            save_json(res, a.out)
        del w13, w2, pair
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if table:
        path = dev.path(str(CONFIG_DIR / f"moe-{dev.slug}.json"), a.configs_out)
        write_configs(path, dev.name, {KERNEL: table},
                      meta={"date": res["date"], "command": res["command"],
                            "torch": torch.__version__, "triton": tuners.triton_version()})
        print(f"wrote {path}")
        tuners.copy_to_out(path)


if __name__ == "__main__":
    main()
