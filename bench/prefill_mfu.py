"""Prefill of one long prompt against the bf16 matmul peak measured in the same run (H200).

  python bench/prefill_mfu.py --model llama-3.1-8b --prompt-len 8192
  python bench/prefill_mfu.py --smoke   # a tiny random model on the CPU: the code only

Linear-layer FLOPs = 2 * tokens * (non-embedding weight parameters); attention FLOPs are
reported separately (causal: 2 * 2 * layers * heads * head_dim * tokens^2 / 2).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from skyline.bench.floor import matmul_peak
from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


SMOKE_LEN = 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, a short prompt, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("prefill_mfu", a.smoke)
    if a.smoke:
        a.model, a.prompt_len = tiny_model(), SMOKE_LEN
    peak = matmul_peak(torch.device(device))
    llm = LLM(a.model, load_format=a.load_format, max_model_len=a.prompt_len + 64,
              max_num_batched_tokens=a.prompt_len, max_num_seqs=4, device=device)
    arch = llm.config.model.arch
    cost = llm.query("model_cost")  # the embedding is a lookup: not counted
    params = cost.linear_params + cost.head_params
    prompt = random_prompts(2, a.prompt_len, arch.vocab_size)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt[0]], one)  # warm-up (kernel compilation)
    sync(device)
    t0 = time.perf_counter()
    llm.generate([prompt[1]], one)
    sync(device)
    dt = time.perf_counter() - t0
    n = a.prompt_len
    linear_flops = 2 * n * params
    attn_flops = 2 * arch.num_layers * arch.num_heads * arch.head_dim * n * n  # QK^T + PV, causal
    res = {
        "benchmark": "prefill_mfu", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": a.model, "dtype": llm.config.model.dtype, "prompt_len": n,
        "matmul_peak_TFLOPs": peak / 1e12, "ttft_s": dt,
        "linear_TFLOPs_achieved": linear_flops / dt / 1e12,
        "linear_fraction_of_peak": linear_flops / dt / peak,
        "total_fraction_of_peak": (linear_flops + attn_flops) / dt / peak,
        "machine": machine_info(device),
    }
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
