"""The MoE MLP at decode sizes on this GPU: the decode GEMVs (ops/moe_gemv.py) against the
grouped GEMMs (ops/moe.py's fused_moe_triton), for Qwen3-30B-A3B's experts (bf16, and fp8) and
gpt-oss-20b's (MXFP4), at 1, 2, 4 and 8 tokens (--tokens: MXFP4 up to 32); microseconds per
call and the bandwidth of the distinct experts' bytes each call reads, against the copy
bandwidth measured in the same run.
With --tune, candidate launch configurations of the two GEMV kernels (up, then down with the
best up) are timed too and the fastest written to the tuning table
(skyline/ops/configs/moe-gemv-<gpu>.json, kernels "moe_gemv_up" / "moe_gemv_down").

Timing: calls captured in one CUDA graph (as decode replays them), each call with another
routing, cycling over enough routings that the experts they read exceed L2 (an H200's is
50 MB): the bytes come from HBM, as in a decode step, where 48 layers' experts pass through.

  python bench/kernels/moe_gemv_speed.py --out /tmp/out/moe-gemv.json
  python bench/kernels/moe_gemv_speed.py --tune --budget-s 240
  python bench/kernels/moe_gemv_speed.py --smoke      # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench import tuners  # noqa: E402
from skyline.ops.tuning import CONFIG_DIR, dtype_name, write_configs  # noqa: E402

SHAPES = {  # experts, hidden, intermediate, top-k, activation, bias
    "qwen3-30b-a3b": (128, 2048, 768, 8, "silu", False),
    "gpt-oss-20b": (32, 2880, 2880, 4, "swiglu_oai", True),
}
CASES = (("qwen3-30b-a3b", "dense"), ("qwen3-30b-a3b", "fp8"), ("gpt-oss-20b", "mxfp4"))


def make(e: int, h: int, i: int, fmt: str, bias: bool, device: torch.device,
         dtype: torch.dtype) -> list[Any]:
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


def expert_bytes(w13: Any, w2: Any) -> int:
    return sum(w.weight[0].numel() * w.weight.element_size()
               + (0 if w.scale is None else w.scale[0].numel() * w.scale.element_size())
               for w in (w13, w2))


def candidates(kernel: str, base: dict[str, Any], fmt: str, smoke: bool
               ) -> list[dict[str, Any]]:
    """A few tiles around the default: rows per program, K tile, warps (the default first;
    two in all for a smoke run); in the default's mode (MXFP4's integer mode: tiles of 1-4
    rows, 1 or 2 warps)."""
    out = [base]
    if base.get("A8"):
        for bk in (512, 1024, 2048):
            for bn in (1, 2, 4):
                for warps in (1, 2):
                    cfg = {**base, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}
                    if cfg not in out:
                        out.append(cfg)
        return out[:2] if smoke else out
    mx = fmt == "mxfp4"
    rows = ((8, 16) if mx else (8, 16, 32)) if kernel == "moe_gemv_up" else \
        ((4, 8) if mx else (4, 8, 16))
    # MXFP4: K tiles up to 1,024 (512 bytes a row), the loop rolled or unrolled
    tiles = (256, 512, 1024) if mx else (base["BLOCK_K"], 2 * base["BLOCK_K"])
    for bk in tiles:
        for unroll in (True, False) if mx else (base.get("UNROLL", True),):
            for bn in rows:
                for warps in (4, 8) if mx else (2, 4, 8):
                    cfg = {**base, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                           "UNROLL": unroll}
                    if cfg not in out:
                        out.append(cfg)
    return out[:2] if smoke else out


def time_op(op: Any, x: torch.Tensor, w13: Any, w2: Any, routes: list[Any], act: str,
            limit: float | None, calls: int, **kw: Any) -> float:
    """Seconds per call of `op`, the calls cycling over `routes` in one CUDA graph."""
    fns = [lambda r=r: op(x, w13, w2, *r, act, limit, **kw) for r in routes]
    return tuners.time_calls(fns, calls)


def fastest(op: Any, case: tuple, want: torch.Tensor, options: Any, deadline: float
            ) -> tuple[float, Any]:
    """The fastest of `options`, pairs (tag, keyword arguments of `op`), as (seconds per call,
    tag): each checked against `want` first (relative error below 2e-2), then timed as time_op
    times `case`; one this GPU cannot run, or that misses, is reported and left out; none is
    tried after `deadline` (time.time()) but the first."""
    x, w13, w2, routes, act, limit, _ = case
    timed = []
    for tag, kw in options:
        try:
            got = op(x, w13, w2, *routes[0], act, limit, **kw).float()
            err = ((got - want).norm() / want.norm()).item()
            if not err < 2e-2:
                raise AssertionError(f"relative error {err:.3g}")
            timed.append((time_op(op, *case, **kw), tag))
        except Exception as ex:  # a configuration this GPU cannot run
            print(f"  {op.__name__} {tag}: {type(ex).__name__}: {ex}"[:300])
        if time.time() > deadline:
            break
    return min(timed, key=lambda st: st[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON report")
    ap.add_argument("--tune", action="store_true", help="time candidates, write the table")
    ap.add_argument("--configs-out", default=None,
                    help="tuning table (default skyline/ops/configs/moe-gemv-<gpu>.json)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="--tune: stop tuning after")
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES),
                    help="the models whose experts are timed")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8],
                    help="token counts (up to the GEMVs' limit: 8, MXFP4 in bf16 32)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from skyline.ops.moe import fused_moe_ref, fused_moe_triton
    from skyline.ops.moe_gemv import KERNELS, fused_moe_gemv, moe_gemv_config
    from skyline.ops.triton_utils import triton

    if triton is None:
        print("skipped: the MoE kernels need triton (on the CPU for Triton's interpreter)")
        return
    dev = tuners.tune_device("moe_gemv_speed", a.smoke)
    device, smoke = dev.device, dev.device.type != "cuda"
    # float32 in the interpreter: MXFP4's integer mode (16-bit activations, tests/ops) would
    # take minutes there
    dtype = torch.float32 if smoke else torch.bfloat16
    copy_bw = tuners.device_bandwidth(dev)
    t0 = time.time()
    rows, table = [], {k: {} for k in KERNELS}
    cases = [c for c in CASES if c[0] in a.models]
    for model, fmt in cases[::2] if smoke else cases:  # smoke: dense and MXFP4
        e, h, i, k, act, bias = SHAPES[model]
        if smoke:
            e, h, i = 8, 64, 32
        w13, w2 = make(e, h, i, fmt, bias, device, dtype)
        per_expert = expert_bytes(w13, w2)
        limit = 7.0 if act == "swiglu_oai" else None
        for t in ((1,) if smoke else a.tokens):
            g = torch.Generator().manual_seed(t)
            # routings cycled through the graph: ~4x L2 of distinct experts' bytes in all
            num = 1 if smoke else max(2, -(-200_000_000 // (t * k * per_expert)))
            routes = [torch.topk(torch.randn(t, e, generator=g).softmax(-1), k)
                      for _ in range(num)]
            routes = [(w.to(device), ids.to(device)) for w, ids in routes]
            x = torch.randn(t, h, device=device, dtype=dtype)
            distinct = sum(r[1].unique().numel() for r in routes) / num
            nbytes = distinct * per_expert
            want = fused_moe_ref(x, w13, w2, *routes[0], act, limit).float()
            calls = 1 if smoke else max(num, 20)
            case = (x, w13, w2, routes, act, limit, calls)

            row: dict[str, Any] = {"model": model, "fmt": fmt, "tokens": t,
                                   "distinct_experts": distinct, "bytes_read_MB": nbytes / 1e6}
            for name, op in (("gemv", fused_moe_gemv), ("grouped", fused_moe_triton)):
                s = time_op(op, *case)
                row[f"{name}_us"] = s * 1e6
                row[f"{name}_frac"] = nbytes / s / copy_bw
            best = [moe_gemv_config(kn, t, w, dtype) for kn, w in zip(KERNELS, (w13, w2),
                                                                       strict=True)]
            if a.tune and time.time() - t0 < a.budget_s:
                for j, kn in enumerate(KERNELS):
                    options = ((cfg, {"configs": tuple(cfg if jj == j else best[jj]
                                                       for jj in range(2))})
                               for cfg in candidates(kn, best[j], fmt, smoke))
                    best[j] = fastest(fused_moe_gemv, case, want, options, t0 + a.budget_s)[1]
                    w = (w13, w2)[j]
                    key = f"n{w.n}:k{w.k}:{w.fmt}:{dtype_name(dtype)}:t{t}"
                    table[kn][key] = best[j]
                s = time_op(fused_moe_gemv, *case, configs=tuple(best))
                row |= {"tuned_us": s * 1e6, "tuned_frac": nbytes / s / copy_bw,
                        "tuned": best}
            rows.append(row)
            tuned = f", tuned {row['tuned_us']:7.1f} us ({row['tuned_frac']:.2f})" \
                if "tuned_us" in row else ""
            print(f"{model:14} {fmt:6} T={t}: gemv {row['gemv_us']:7.1f} us "
                  f"({row['gemv_frac']:.2f} of copy bw), grouped {row['grouped_us']:7.1f} us "
                  f"({row['grouped_frac']:.2f}){tuned}; {distinct:.1f} experts "
                  f"{nbytes / 1e6:.1f} MB", flush=True)
        del w13, w2
        if device.type == "cuda":
            torch.cuda.empty_cache()
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if a.tune and any(table.values()):
        path = dev.path(str(CONFIG_DIR / f"moe-gemv-{dev.slug}.json"), a.configs_out)
        write_configs(path, dev.name, {k: v for k, v in table.items() if v},
                      meta={"date": date, "command": "python " + " ".join(sys.argv),
                            "torch": torch.__version__, "triton": tuners.triton_version()})
        print(f"wrote {path}")
        tuners.copy_to_out(path)
    res = {"benchmark": "moe_gemv_speed", "date": date, "device": dev.name,
           "torch": torch.__version__, "copy_bandwidth_TBps": copy_bw / 1e12, "rows": rows}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
