"""The GEMV's tuner (skyline/ops/gemv.py): candidate launch configurations for an [m, k] x [n, k]^T
product, each checked against gemv_ref and timed as GPU time per call in a CUDA graph of
back-to-back calls cycling over enough weight copies that L2 cannot serve them; the fastest wins.
Used by `skyline tune` and bench/kernels/tune_gemv.py.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from skyline.bench import tuners
from skyline.ops.gemv import KERNEL, MAX_ROWS, config_key, default_config, gemv, gemv_ref
from skyline.tune.workload import model_linears

__all__ = ["KERNEL", "candidates", "tune_shape", "tune_model"]


def candidates(m: int, n: int, k: int, num_sms: int) -> list[dict[str, Any]]:
    """Launch configurations worth timing for an [m, k] x [n, k]^T product.

    FMA tiles for up to four rows (each thread keeps at most 64 fp32 accumulators; beyond four
    rows the repeated x loads cost more than tensor cores), tensor-core tiles for every m; split K
    from 1 up to ~16 waves of programs, keeping at least max(2, num_stages) K tiles per split.
    Unpipelined tiles (num_stages 1) are also tried with PREFETCH (the next W tile loaded into
    registers a step ahead) where the splits' K tiles are whole.
    """
    tiles: list[tuple[bool, int, int, int, int]] = []  # (dot, BLOCK_N, BLOCK_K, warps, stages)
    if m <= 4:
        for bn, bk, warps in [(16, 256, 4), (32, 256, 4), (8, 512, 4), (16, 512, 4), (8, 256, 2),
                              (4, 512, 4), (4, 1024, 4)]:
            if bn * m * bk // (32 * warps) <= 64:
                tiles += [(False, bn, bk, warps, 1), (False, bn, bk, warps, 3)]
    tiles += [(True, 64, 128, 4, 3), (True, 64, 128, 4, 5), (True, 64, 256, 4, 3),
              (True, 128, 128, 4, 3), (True, 128, 64, 4, 4), (True, 32, 256, 4, 4),
              (True, 64, 128, 4, 1), (True, 64, 256, 4, 1)]
    out, seen = [], set()
    for dot, bn, bk, warps, stages in tiles:
        programs = -(-n // bn)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (k // (split * bk) < max(2, stages)
                              or programs * split > 16 * num_sms):
                break
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "USE_DOT": dot,
                   "num_warps": warps, "num_stages": stages}
            out.append(cfg)
            seen.add(json.dumps(cfg, sort_keys=True))
            if stages == 1 and k % (split * bk) == 0:  # the next W tile loaded a step ahead
                out.append({**cfg, "PREFETCH": True})
    base = default_config(m, n, k, num_sms)
    if json.dumps(base, sort_keys=True) not in seen:
        out.append(base)
    return out


def tune_shape(n: int, k: int, rows: list[int], copy_bw: float, dev: tuners.TuneDevice,
               dtype: torch.dtype) -> list[dict[str, Any]]:
    nbytes = n * k * dtype.itemsize
    num_copies = 1 if dev.out_dir else max(1, math.ceil(tuners.ROTATE_BYTES / nbytes))
    weights = [torch.randn(n, k, device=dev.device, dtype=dtype) * 0.02
               for _ in range(num_copies)]
    calls = num_copies * max(1, round(tuners.REPLAY_S * 4e12 / nbytes / num_copies))
    calls = 1 if dev.out_dir else min(calls, 512)
    frac = lambda t: nbytes / t / copy_bw  # noqa: E731
    results = []
    for m in rows:
        x = torch.randn(m, k, device=dev.device, dtype=dtype)
        ref = gemv_ref(x, weights[0]).float()
        tol = 1e-2 * ref.abs().max().item() + 1e-3
        t_cublas = tuners.time_calls([lambda w=w, x=x: F.linear(x, w) for w in weights], calls)
        timed, failed = [], []
        cands = candidates(m, n, k, dev.num_sms)
        for cfg in cands[:2] + cands[-1:] if dev.out_dir else cands:
            try:
                err = (gemv(x, weights[0], config=cfg).float() - ref).abs().max().item()
                if not err <= tol:
                    raise AssertionError(f"max error {err:.3g} > {tol:.3g}")
                fns = [lambda w=w, x=x, c=cfg: gemv(x, w, config=c) for w in weights]
                t = tuners.time_calls(fns, calls)
            except Exception as e:  # a config the GPU cannot run (e.g. too much shared memory)
                failed.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            timed.append((t, cfg))
        if not timed:
            raise SystemExit(f"no GEMV config ran for {n}x{k}, m={m}: {failed[:2]}")
        timed.sort(key=lambda tc: tc[0])
        t_best, best = timed[0]
        base = default_config(m, n, k, dev.num_sms)
        t_default = next((t for t, c in timed if c == base), None)
        res = {
            "N": n, "K": k, "rows": m, "key": config_key(m, n, k), "weight_MB": nbytes / 1e6,
            "cublas_us": t_cublas * 1e6, "cublas_frac": frac(t_cublas),
            "gemv_us": t_best * 1e6, "gemv_frac": frac(t_best),
            "speedup_vs_cublas": t_cublas / t_best, "config": best,
            "default_us": None if t_default is None else t_default * 1e6,
            "default_frac": None if t_default is None else frac(t_default),
            "timed": [{"us": t * 1e6, "frac": frac(t), "config": c} for t, c in timed],
            "num_timed": len(timed), "failed": failed,
        }
        results.append(res)
        print(f"{n:>6}x{k:<6} m={m}  cuBLAS {res['cublas_us']:7.1f} us ({res['cublas_frac']:.2f})"
              f"  gemv {res['gemv_us']:7.1f} us ({res['gemv_frac']:.2f})  "
              f"{res['speedup_vs_cublas']:.2f}x  {best}", flush=True)
    del weights
    if dev.device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def tune_model(arch: Any, rows: list[int], budget_s: float, dev: tuners.TuneDevice,
               dtype: torch.dtype, log: Any = print) -> dict[str, dict[str, dict[str, Any]]]:
    """{KERNEL: {key: config}}: the fastest configuration for each Linear shape of `arch` at
    each of `rows` (row counts the GEMV takes), shapes in turn until `budget_s` is spent."""
    t0 = time.monotonic()
    copy_bw = tuners.device_bandwidth(dev)
    rows = sorted({r for r in rows if 1 <= r <= MAX_ROWS})
    table: dict[str, dict[str, Any]] = {}
    for n, k in model_linears(arch):
        if time.monotonic() - t0 > budget_s:
            log(f"  GEMV: the budget is spent before {n}x{k}")
            break
        for r in tune_shape(n, k, rows, copy_bw, dev, dtype):
            if r["default_us"] is None or r["gemv_us"] < r["default_us"]:
                table[r["key"]] = r["config"]
    return {KERNEL: table} if table else {}
