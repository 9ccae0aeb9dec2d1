"""Stored offline runs against their floor (skyline/bench/floor.py), without a device.

The model is built on PyTorch's meta device (no memory, no weights) in the run's weight format,
so its cost per token is that of the layers the engine serves with; the peaks are given, from
stored measurements of the same machine (cite their JSON). A run whose products need a peak not
given (fp8 weights without --fp8-peak-tflops) gets its bandwidth-bound parts only.

    python bench/offline_floor.py --peak-tflops 802.2 --bandwidth-tbps 4.155 \\
        --runs bench/results/offline/offline-h200-*1000x1000*.json \\
        --out bench/results/offline/offline-floor-h200.json
    python bench/offline_floor.py --smoke   # one stored run, no JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import Any

from skyline.bench.floor import offline_floor
from skyline.bench.offline import save_json
from skyline.engine.cost import model_cost


def run_floor(run: dict[str, Any], peak: float | None, bandwidth: float) -> dict[str, Any]:
    quant = run.get("quantization") or "none"
    fp8_kv = run.get("kv_cache_dtype") == "fp8_e4m3"
    cost = model_cost(run["model"], quant, "fp8" if fp8_kv else "auto")
    tokens = run["engine"].get("kv_cache_tokens")
    length = run["input_len"] + run["output_len"]
    concurrency = min(run["max_num_seqs"], tokens // length if tokens else run["max_num_seqs"])
    floor = offline_floor(cost, run["num_prompts"], run["input_len"], run["output_len"],
                          concurrency, peak or float("inf"), bandwidth)
    elapsed = run["skyline"]["elapsed_s"]
    row = {"model": run["model"], "quantization": quant, "kv_cache_dtype":
           run.get("kv_cache_dtype"), "date": run.get("date"), "elapsed_s": elapsed,
           "output_tokens_per_s": run["skyline"]["output_tokens_per_s"]}
    if peak is None:  # products unknown: only what the bytes alone take
        keep = ("bandwidth_TBps", "concurrency", "decode_steps", "cost", "decode_attention_s")
        return row | {k: floor[k] for k in keep} | {
            "attention_fraction_of_run": floor["decode_attention_s"] / elapsed}
    return row | floor | {"fraction_of_sequential": floor["sequential_s"] / elapsed,
                          "fraction_of_overlapped": floor["overlapped_s"] / elapsed}


SMOKE_RUN = os.path.join(os.path.dirname(__file__), "results", "offline",
                         "offline-h200-llama-3.1-8b-1000x1000-wnone-kvbf16-1warp.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", help="offline result JSON files (required)")
    ap.add_argument("--peak-tflops", type=float, help="bf16 matmul peak (required)")
    ap.add_argument("--fp8-peak-tflops", type=float, default=None)
    ap.add_argument("--bandwidth-tbps", type=float, help="copy bandwidth (required)")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true",
                    help="one stored H200 run against the H200's stored peaks, no JSON")
    a = ap.parse_args()
    if a.smoke:
        a.runs, a.peak_tflops, a.bandwidth_tbps, a.out = [SMOKE_RUN], 802.2, 4.155, None
    if not (a.runs and a.peak_tflops and a.bandwidth_tbps):
        ap.error("--runs, --peak-tflops and --bandwidth-tbps are required")
    rows = []
    for path in a.runs:
        with open(path) as f:
            run = json.load(f)
        fp8 = (run.get("quantization") or "none") == "fp8"
        peak = a.fp8_peak_tflops if fp8 else a.peak_tflops
        row = run_floor(run, peak * 1e12 if peak else None, a.bandwidth_tbps * 1e12)
        row["file"] = path.rsplit("/", 1)[-1]
        rows.append(row)
        w, kv = row["quantization"], row["kv_cache_dtype"]
        head = (f"{row['file']}: {row['output_tokens_per_s']:,.0f} tok/s, weights {w}, KV {kv}, "
                f"{row['concurrency']} at a time")
        if "sequential_s" in row:
            print(f"{head}: floor sequential {row['sequential_s']:.1f} s "
                  f"({row['sequential_tok_s']:,.0f} tok/s; prefill {row['prefill_s']:.1f}, "
                  f"products {row['decode_linear_s']:.1f}, attention "
                  f"{row['decode_attention_s']:.1f}), overlapped {row['overlapped_s']:.1f} s; "
                  f"run {row['elapsed_s']:.1f} s = {row['fraction_of_sequential']:.2f} of the "
                  "sequential floor")
        else:
            print(f"{head}: decode attention alone {row['decode_attention_s']:.1f} s of the "
                  f"run's {row['elapsed_s']:.1f} (no peak for its products)")
    save_json({"benchmark": "offline_floor",
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "peak_TFLOPs": a.peak_tflops, "fp8_peak_TFLOPs": a.fp8_peak_tflops,
               "bandwidth_TBps": a.bandwidth_tbps, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
