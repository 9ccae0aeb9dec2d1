"""Decode speed of the default GGUF model with its blocks kept packed (--quantization gguf)
vs dequantized once at load (the default), in float32 and bfloat16, on this machine. Packed
float32 dequantizes the blocks at every forward; packed bfloat16 runs the Q4 layers on torch's
CPU int4 kernel (quant/gguf.py).

    python bench/gguf_packed_speed.py [--threads N] [--model FILE.gguf]
                                      [--out bench/results/cpu/gguf-packed-cpu.json]
    python bench/gguf_packed_speed.py --smoke   # a tiny random model, none vs int4: the code

`--methods none,int4,int8` compares other --quantization values the same way (skyline's own
INT4 / INT8 run the same CPU int4 kernel in bfloat16).

Decides quant/resolve.py's GGUF_PACKED_BY_DEFAULT: packed becomes the default only if its
float32 decode is at most 1.5x slower.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from skyline.bench.smoke import tiny_model
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams


def decode_tok_s(llm: LLM, batch: int, prompt_len: int, out_len: int) -> float:
    prompts = [[(7 * i + j) % 1000 + 100 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)  # prefill (+1 token) alone
    prefill = time.perf_counter() - t0
    params = SamplingParams(max_tokens=out_len + 1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    total = time.perf_counter() - t0
    return batch * out_len / max(total - prefill, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cpu/gguf-packed-cpu.json")
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--methods", default="none,gguf",
                    help="comma-separated --quantization values; none first (the baseline)")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated, float32 first (the packed-by-default decision)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model (no GGUF blocks): none against int4, 2 tokens")
    ns = ap.parse_args()
    load_format, prompt_len = "auto", 64
    if ns.smoke:
        ns.model, load_format, ns.methods, ns.dtypes = tiny_model(), "dummy", "none,int4", \
            "float32"
        ns.out, ns.out_len, prompt_len = None, 2, 8
    results: dict[str, dict[str, float]] = {}
    variants = [(m, d) for d in ns.dtypes.split(",") for m in ns.methods.split(",")]
    for method, dtype in variants:
        key = method if dtype == "float32" else f"{method}-{dtype}"
        smoke = {"device": "cpu", "max_model_len": 256} if ns.smoke else {}
        llm = LLM(model=ns.model, load_format=load_format, quantization=method, dtype=dtype,
                  threads=ns.threads, enable_prefix_caching=False, **smoke)
        decode_tok_s(llm, 1, 16, 4)  # warm-up (builds the int4 kernel's packed weights)
        if not ns.smoke:
            decode_tok_s(llm, 8, 16, 4)
        results[key] = {
            # weights held after the warm-up, the int4 kernel's included
            "weights_mib": llm.query("describe")["weights_gib"] * 1024,
            "decode_tok_s_b1": decode_tok_s(llm, 1, prompt_len, ns.out_len),
            "decode_tok_s_b8": decode_tok_s(llm, 8, prompt_len, ns.out_len),
        }
        print(key, results[key], flush=True)
        del llm
    slow = {f"{b}{sfx}": results["none" + sfx][b] / results["gguf" + sfx][b]
            for sfx in ("", "-bfloat16") if "gguf" + sfx in results
            for b in ("decode_tok_s_b1", "decode_tok_s_b8")}
    report = {
        "machine": platform.processor() or platform.machine(),
        "threads": ns.threads or torch.get_num_threads(),
        "command": "python bench/gguf_packed_speed.py " + " ".join(sys.argv[1:]),
        "model": ns.model or "SmolLM2-135M-Instruct Q4_1 (default)",
        "results": results,
        "packed_slowdown": slow,
        "packed_by_default": ("gguf" in results and max(
            v for k, v in slow.items() if not k.endswith("-bfloat16")) <= 1.5),
        "date": time.strftime("%Y-%m-%d"),
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report["packed_slowdown"]), "->", ns.out)


if __name__ == "__main__":
    main()
