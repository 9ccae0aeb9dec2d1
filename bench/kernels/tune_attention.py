"""Tune the paged attention kernels (skyline/ops/attention.py) on this GPU: decode over a grid
of batch sizes x context lengths and causal prefill, against the copy bandwidth measured in the
same run.

  python bench/kernels/tune_attention.py   # llama-3.1-8b / qwen3-8b (32 q heads, 8 kv, d128)
  python bench/kernels/tune_attention.py --batches 1 256 --contexts 1000 --no-prefill \
      --kv-dtypes fp8
  python bench/kernels/tune_attention.py --smoke   # seconds, on the CPU (skyline/bench/tuners.py)

Decode: for each (batch, context) a paged cache of the model's shape (pages of --page tokens,
shuffled, as the engine's block pool hands them out), every candidate launch configuration
checked against the PyTorch reference (fp32) and timed as GPU time per call in a CUDA graph of
back-to-back calls cycling over disjoint sets of pages (at least ROTATE_BYTES of K/V, so L2
cannot serve them; one layer's cache per call, as a decode step runs). Phase 1 sweeps tiles and
pipeline depths at the default split count, phase 2 the split count for the two best tiles.
Per batch size the configuration with the best mean time relative to the fastest at each
context wins (a CUDA graph is captured per batch size, so the context cannot choose). Reported
as K/V bytes / time / copy bandwidth (read + write bytes of a 1 GiB device-to-device copy).

Prefill: 8 x 1000-token and 1 x 8192-token prompts; tiles and pipeline depths; TFLOP/s of the
causal attention, against the reference (gather + SDPA) and the unpipelined loop.

Winners go into the tuning table (--configs-out, default skyline/ops/configs/attention-<gpu>.json
and a copy under $OUT when set); everything measured, failures included, into --out. A config
that fails to compile or run, or mismatches the reference, is recorded and skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.bench.tuners import (  # noqa: E402
    copy_to_out,
    device_bandwidth,
    triton_version,
    tune_device,
)
from skyline.ops import attention as attn  # noqa: E402
from skyline.ops.tuning import CONFIG_DIR, write_configs  # noqa: E402
from skyline.tune.attention import (  # noqa: E402
    KV_DTYPES,
    ROTATE_BYTES,
    SMOKE_SHAPES,
    TOL,
    attention_shapes,
    query_dtype,
    tune_decode,
    tune_prefill,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen3-8b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256, 512],
                    help="decode batch sizes, powers of two (each covers the sizes up to the "
                         "next one)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[1000, 4000])
    ap.add_argument("--page", type=int, default=16, help="KV block size (the engine's default)")
    ap.add_argument("--kv-dtypes", nargs="+", choices=sorted(KV_DTYPES), default=["bf16"])
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--budget-s", type=float, default=180,
                    help="after this many seconds, skip the split sweeps of later batch sizes")
    ap.add_argument("--configs-out", default=None, help="tuning table to merge into "
                    "(default skyline/ops/configs/attention-<gpu>.json)")
    ap.add_argument("--out", default=None, help="results JSON "
                    "(default bench/results/kernels/attention-tune-<gpu>.json, or under $OUT)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape, two batches, a few configurations, on the CPU without "
                         "a GPU")
    a = ap.parse_args()
    dev = tune_device("tune_attention", a.smoke)
    if any(b < 1 or b & (b - 1) for b in a.batches):
        sys.exit(f"--batches must be powers of two (the tuned buckets), got {a.batches}")
    smoke = dev.out_dir is not None
    if smoke:
        a.batches, a.contexts, a.kv_dtypes = [1, 2], [40], ["bf16"]
    t0 = time.time()
    name, slug, num_sms = dev.name, dev.slug, dev.num_sms
    copy_bw = device_bandwidth(dev, 2**29)  # 1 GiB
    print(f"{name}: copy bandwidth (read + write) {copy_bw / 1e12:.2f} TB/s, {num_sms} SMs",
          flush=True)
    shapes = SMOKE_SHAPES if smoke else attention_shapes(a.models)
    decode, prefill = [], []
    configs: dict[str, dict[str, dict]] = {attn.DECODE_KERNEL: {}, attn.PREFILL_KERNEL: {}}
    for shape, layers in shapes.items():
        print(f"heads {shape[0]}/{shape[1]}, head_dim {shape[2]}: {', '.join(layers)}",
              flush=True)
        for kv in a.kv_dtypes:
            kv_dtype = KV_DTYPES[kv] if dev.device.type == "cuda" else query_dtype(dev.device)
            rows, chosen = [], {}
            if not a.no_decode:
                rows, chosen = tune_decode(shape, kv_dtype, sorted(a.batches), a.contexts,
                                           a.page, copy_bw, num_sms, t0 + a.budget_s, smoke,
                                           dev.device)
            for r in rows:
                r["layers_ms"] = {m: n * r["chosen_us"] / 1e3 for m, n in layers.items()}
                r["layers_ms_baseline"] = {m: None if r["baseline_us"] is None
                                           else n * r["baseline_us"] / 1e3
                                           for m, n in layers.items()}
            decode += rows
            configs[attn.DECODE_KERNEL].update(chosen)
            if not a.no_prefill:
                rows, chosen = tune_prefill(shape, kv_dtype, a.page, smoke, dev.device)
                prefill += rows
                configs[attn.PREFILL_KERNEL].update(chosen)
    command = "python " + " ".join(sys.argv)
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    configs_out = dev.path(str(CONFIG_DIR / f"attention-{slug}.json"), a.configs_out)
    write_configs(configs_out, name, {k: v for k, v in configs.items() if v},
                  meta={"date": date, "command": command, "torch": torch.__version__,
                        "triton": triton_version(), "models": ",".join(a.models),
                        "page": a.page})
    print(f"wrote {configs_out}")
    copy_to_out(configs_out)
    out_dir = os.environ.get("OUT") or "bench/results/kernels"
    save_json({"benchmark": "tune_attention", "date": date, "command": command, "device": name,
               "copy_bandwidth_TBps": copy_bw / 1e12, "num_sms": num_sms, "page": a.page,
               "rotate_bytes": ROTATE_BYTES, "tolerance": TOL, "wall_s": time.time() - t0,
               "decode": decode, "prefill": prefill, "configs": configs,
               "machine": machine_info(dev.device.type)},
              dev.path(os.path.join(out_dir, f"attention-tune-{slug}.json"), a.out))
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
