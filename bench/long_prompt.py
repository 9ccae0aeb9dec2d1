"""One very long prompt (default 200,000 tokens) through chunked prefill on one GPU: TTFT against
the compute floor measured in the same run.

  python bench/long_prompt.py --model llama-3.1-8b --prompt-len 200000 --chunk 8192
  python bench/long_prompt.py --smoke   # a tiny random model on the CPU: the code only

Floor = (linear FLOPs + causal attention FLOPs) / the bf16 matmul peak measured here. Linear:
2 * tokens * non-embedding weights. Attention: QK^T and PV over the causal triangle,
2 * 2 * layers * heads * head_dim * tokens^2 / 2. Beyond the trained context (Llama-3.1: 131,072)
the rotary table is extended; with dummy weights only the speed is meaningful.
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


SMOKE_LEN = 256


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-len", type=int, default=200_000)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk (token budget)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, a short prompt, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("long_prompt", a.smoke)
    if a.smoke:
        a.model, a.prompt_len = tiny_model(), SMOKE_LEN
    peak = matmul_peak(torch.device(device))
    if a.smoke:
        a.chunk = 64
    llm = LLM(a.model, load_format=a.load_format, max_model_len=a.prompt_len + 64,
              max_num_batched_tokens=a.chunk, max_num_seqs=4, device=device)
    arch = llm.config.model.arch
    cost = llm.query("model_cost")  # the embedding is a lookup: not counted
    params = cost.linear_params + cost.head_params
    warm, prompt = random_prompts(2, a.prompt_len, arch.vocab_size)
    two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([warm[: 2 * a.chunk]], two)  # kernel compilation
    sync(device)
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    for delta in llm.stream(prompt, two):
        if ttft is None:
            ttft = time.perf_counter() - t0
        tokens += delta.outputs[0].token_ids
    total = time.perf_counter() - t0
    n = a.prompt_len
    linear = 2 * n * params
    attn = 2 * arch.num_layers * arch.num_heads * arch.head_dim * n * n
    floor = (linear + attn) / peak
    res = {
        "benchmark": "long_prompt", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": a.model, "dtype": llm.config.model.dtype, "prompt_len": n, "chunk": a.chunk,
        "matmul_peak_TFLOPs": peak / 1e12, "linear_PFLOP": linear / 1e15,
        "attention_PFLOP": attn / 1e15, "compute_floor_s": floor, "ttft_s": ttft,
        "ttft_over_floor": ttft / floor, "fraction_of_peak": floor / ttft,
        "two_tokens_s": total, "kv_cache_tokens": llm.query("describe")["kv_cache_tokens"],
        "output_tokens": tokens, "machine": machine_info(device),
    }
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
