"""Decode speed of the default GGUF model with its blocks kept packed (--quantization gguf,
dequantized at every forward) vs dequantized once at load (the default), on this machine.

    python bench/gguf_packed_speed.py [--out bench/results/gguf-packed-cpu.json]

Decides quant/resolve.py's GGUF_PACKED_BY_DEFAULT: packed becomes the default only if its
decode is at most 1.5x slower.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from skyline.engine.frontend import LLM
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
    ap.add_argument("--out", default="bench/results/gguf-packed-cpu.json")
    ap.add_argument("--out-len", type=int, default=32)
    ns = ap.parse_args()
    results: dict[str, dict[str, float]] = {}
    for method in ("none", "gguf"):
        llm = LLM(quantization=method, enable_prefix_caching=False)
        model = llm.engine.executor.runner.model if hasattr(llm.engine, "executor") else None
        mem = None
        if model is not None:
            tensors = [*model.parameters(), *model.buffers()]
            mem = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        decode_tok_s(llm, 1, 16, 4)  # warm-up
        results[method] = {
            "weights_mib": mem,
            "decode_tok_s_b1": decode_tok_s(llm, 1, 64, ns.out_len),
            "decode_tok_s_b8": decode_tok_s(llm, 8, 64, ns.out_len),
        }
        print(method, results[method], flush=True)
        del llm
    slow = {b: results["none"][b] / results["gguf"][b] for b in ("decode_tok_s_b1",
                                                                   "decode_tok_s_b8")}
    report = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "model": "SmolLM2-135M-Instruct Q4_1 (default)",
        "results": results,
        "packed_slowdown": slow,
        "packed_by_default": max(slow.values()) <= 1.5,
        "date": time.strftime("%Y-%m-%d"),
    }
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["packed_slowdown"]), "->", ns.out)


if __name__ == "__main__":
    main()
