"""Tune the small-batch GEMV (skyline/ops/gemv.py) on this GPU against cuBLAS and the copy
bandwidth measured in the same run.

  python bench/kernels/tune_gemv.py      # llama-3.1-8b and qwen3-8b shapes, rows 1,2,4,8
  python bench/kernels/tune_gemv.py --models llama-3.1-8b --rows 1 --report /tmp/gemv.json
  python bench/kernels/tune_gemv.py --smoke   # seconds, on the CPU (skyline/bench/tuners.py)

For each Linear shape of the shipped configs (qkv, o, gate_up, down, lm_head) and each row count,
every candidate launch configuration is checked against gemv_ref and timed; the fastest goes
into the tuning table (`--configs-out`, default skyline/ops/configs/gemv-<gpu>.json, also
copied to $OUT when set). Timing: one CUDA graph of back-to-back calls (as decode replays them)
cycling over enough copies of the weight that L2 (50 MB on an H200) cannot serve it; the same
for cuBLAS `F.linear`. Bandwidth fraction = weight bytes / time / copy bandwidth (read + write
bytes of a 2 GiB device-to-device copy), as in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from skyline.bench import tuners  # noqa: E402
from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.ops.gemv import KERNEL, config_key, default_config, gemv, gemv_ref  # noqa: E402
from skyline.ops.tuning import CONFIG_DIR, write_configs  # noqa: E402

SMOKE_SHAPES = {(64, 512): ["llama-3.1-8b.qkv"], (32, 256): ["llama-3.1-8b.down"]}


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
            "top5": [{"us": t * 1e6, "frac": frac(t), "config": c} for t, c in timed[:5]],
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


def step_summary(shapes: dict[tuple[int, int], list[str]], results: list[dict[str, Any]],
                 models: list[str], copy_bw: float) -> dict[str, Any]:
    """Per model and row count: the Linear layers of one decode step (not the LM head, which
    does not go through the GEMV), cuBLAS against the tuned GEMV, as a bandwidth fraction."""
    by = {(r["N"], r["K"], r["rows"]): r for r in results}
    out: dict[str, Any] = {}
    for model in models:
        num_layers = tuners.shipped_config(model)["num_hidden_layers"]
        mine = [nk for nk, names in shapes.items()
                for name in names if name.startswith(model + ".") and not name.endswith("lm_head")]
        for m in sorted({r["rows"] for r in results}):
            rs = [by[(n, k, m)] for n, k in mine]
            nbytes = num_layers * sum(r["weight_MB"] * 1e6 for r in rs)
            t_cublas = num_layers * sum(r["cublas_us"] for r in rs) / 1e6
            t_gemv = num_layers * sum(r["gemv_us"] for r in rs) / 1e6
            out[f"{model}:m{m}"] = {
                "layers_weight_GB": nbytes / 1e9, "cublas_ms": t_cublas * 1e3,
                "gemv_ms": t_gemv * 1e3, "cublas_frac": nbytes / t_cublas / copy_bw,
                "gemv_frac": nbytes / t_gemv / copy_bw}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-8b"])
    ap.add_argument("--rows", nargs="+", type=int, choices=[1, 2, 4, 8], default=[1, 2, 4, 8],
                    help="row counts to tune (each covers the counts up to it)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--configs-out", default=None,
                    help="tuning table to merge into (default skyline/ops/configs/gemv-<gpu>.json)")
    ap.add_argument("--report", default=None,
                    help="JSON report (default $OUT/gemv-tune-<gpu>.json, else "
                         "bench/results/kernels/)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, a few configurations, on the CPU without a GPU")
    a = ap.parse_args()
    dev = tuners.tune_device("tune_gemv", a.smoke)
    t0 = time.time()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    name, slug = dev.name, dev.slug
    copy_bw = tuners.device_bandwidth(dev)
    print(f"{name}: copy bandwidth (read + write) {copy_bw / 1e12:.2f} TB/s, "
          f"{dev.num_sms} SMs")
    shapes = SMOKE_SHAPES if dev.out_dir else tuners.linear_shapes(a.models)
    models = ["llama-3.1-8b"] if dev.out_dir else a.models
    rows = a.rows[:2] if dev.out_dir else a.rows
    results = []
    for (n, k), names in shapes.items():
        print(f"{n}x{k}: {', '.join(names)}", flush=True)
        for r in tune_shape(n, k, rows, copy_bw, dev, dtype):
            r["layers"] = names
            results.append(r)
    command = "python " + " ".join(sys.argv)
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    configs_out = dev.path(str(CONFIG_DIR / f"gemv-{slug}.json"), a.configs_out)
    write_configs(configs_out, name, {KERNEL: {r["key"]: r["config"] for r in results}},
                  meta={"date": date, "command": command, "torch": torch.__version__,
                        "triton": tuners.triton_version(), "dtype": a.dtype})
    print(f"wrote {configs_out}")
    tuners.copy_to_out(configs_out)
    report = {
        "benchmark": "tune_gemv", "date": date, "command": command, "device": name,
        "dtype": a.dtype, "copy_bandwidth_TBps": copy_bw / 1e12, "num_sms": dev.num_sms,
        "rotate_bytes": tuners.ROTATE_BYTES, "wall_s": time.time() - t0,
        "decode_step_linears": step_summary(shapes, results, models, copy_bw),
        "shapes": results, "machine": machine_info(dev.device.type),
    }
    out_dir = os.environ.get("OUT") or "bench/results/kernels"
    save_json(report, dev.path(os.path.join(out_dir, f"gemv-tune-{slug}.json"), a.report))
    for key, s in report["decode_step_linears"].items():
        print(f"{key}: decode-step linears {s['layers_weight_GB']:.2f} GB  cuBLAS "
              f"{s['cublas_ms']:.2f} ms ({s['cublas_frac']:.2f})  gemv {s['gemv_ms']:.2f} ms "
              f"({s['gemv_frac']:.2f})")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
