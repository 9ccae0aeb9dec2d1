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
import os
import sys
import time
from typing import Any

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench import tuners  # noqa: E402
from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.ops.tuning import CONFIG_DIR, write_configs  # noqa: E402
from skyline.tune.gemv import KERNEL, tune_shape  # noqa: E402

SMOKE_SHAPES = {(64, 512): ["llama-3.1-8b.qkv"], (32, 256): ["llama-3.1-8b.down"]}


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
