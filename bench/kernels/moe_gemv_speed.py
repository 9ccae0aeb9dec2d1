"""The MoE MLP at decode sizes on this GPU: the decode GEMVs (ops/moe_gemv.py) against the
grouped GEMMs (ops/moe.py's fused_moe_triton), each captured in a CUDA graph, for
Qwen3-30B-A3B's experts (bf16, and fp8) and gpt-oss-20b's (MXFP4), at 1..8 tokens; reports
microseconds per call and the bandwidth of the distinct experts' bytes each call reads.

  python bench/kernels/moe_gemv_speed.py --out /tmp/out/moe-gemv.json
  python bench/kernels/moe_gemv_speed.py --smoke      # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

SHAPES = {  # experts, hidden, intermediate, top-k, activation, bias
    "qwen3-30b-a3b": (128, 2048, 768, 8, "silu", False),
    "gpt-oss-20b": (32, 2880, 2880, 4, "swiglu_oai", True),
}


def make(e: int, h: int, i: int, fmt: str, bias: bool, device: str, dtype: torch.dtype):
    from skyline.ops.fp8_quant import quantize_rows_fp8
    from skyline.ops.moe import ExpertWeights
    from skyline.quant.fp4 import quantize_mxfp4

    out = []
    for n, k in ((2 * i, h), (h, i)):
        w = torch.randn(e * n, k, device=device, dtype=dtype) * 0.02
        b = torch.randn(e, n, device=device, dtype=dtype) * 0.01 if bias else None
        if fmt == "dense":
            out.append(ExpertWeights(w.view(e, n, k), bias=b))
        elif fmt == "fp8":
            q, s = quantize_rows_fp8(w)
            out.append(ExpertWeights(q.view(e, n, k), s.view(e, n), b, "fp8"))
        else:
            codes, scales = quantize_mxfp4(w)
            out.append(ExpertWeights(codes.view(e, n, k // 2), scales.view(e, n, k // 32), b,
                                     "mxfp4"))
        del w
    return out


def timed(fn, device: str, iters: int) -> float:
    """Seconds per call, replayed from a CUDA graph (as batch-1 decode runs it)."""
    fn()
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (iters * 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from skyline.ops.moe import fused_moe_triton
    from skyline.ops.moe_gemv import fused_moe_gemv
    from skyline.ops.triton_utils import triton

    if triton is None:
        print("skipped: the MoE kernels need triton (on the CPU for Triton's interpreter)")
        return

    device = "cpu" if a.smoke else "cuda"
    dtype = torch.float32 if a.smoke else torch.bfloat16
    cases = [("qwen3-30b-a3b", "dense"), ("qwen3-30b-a3b", "fp8"), ("gpt-oss-20b", "mxfp4")]
    rows = []
    for model, fmt in cases:
        e, h, i, k, act, bias = SHAPES[model]
        if a.smoke:
            e, h, i = 8, 64, 32
        w13, w2 = make(e, h, i, fmt, bias, device, dtype)
        per_expert = sum(w.weight[0].numel() * w.weight.element_size()
                         + (0 if w.scale is None else w.scale[0].numel() * w.scale.element_size())
                         for w in (w13, w2))
        limit = 7.0 if act == "swiglu_oai" else None
        for t in ((1,) if a.smoke else (1, 2, 4, 8)):
            g = torch.Generator().manual_seed(t)
            weights, ids = torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
            weights, ids = weights.to(device), ids.to(device)
            x = torch.randn(t, h, device=device, dtype=dtype)
            distinct = ids.unique().numel()
            row = {"model": model, "fmt": fmt, "tokens": t, "distinct_experts": distinct,
                   "bytes_read_MB": distinct * per_expert / 1e6}
            call = (x, w13, w2, weights, ids, act, limit)
            for name, op in (("gemv", fused_moe_gemv), ("grouped", fused_moe_triton)):
                s = timed(lambda op=op, call=call: op(*call), device, 1 if a.smoke else a.iters)
                row[f"{name}_us"] = s * 1e6
                row[f"{name}_GBps"] = distinct * per_expert / s / 1e9
            rows.append(row)
            print(f"{model:14} {fmt:6} T={t}: gemv {row['gemv_us']:8.1f} us "
                  f"({row['gemv_GBps']:6.0f} GB/s), grouped {row['grouped_us']:8.1f} us "
                  f"({row['grouped_GBps']:6.0f} GB/s), {distinct} experts "
                  f"{row['bytes_read_MB']:.1f} MB")
        del w13, w2, call
    res = {"benchmark": "moe_gemv_speed", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                time.gmtime()),
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "torch": torch.__version__, "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
