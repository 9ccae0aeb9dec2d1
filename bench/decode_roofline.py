"""Batch-1 decode against the bandwidth roofline measured in the same run (H200).

  python bench/decode_roofline.py --model llama-3.1-8b --prompt-len 512 --new-tokens 256

Roofline: weights + KV bytes read per token over the measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.engine.frontend import LLM
from skyline.types import SamplingParams


def copy_bandwidth() -> float:
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * x.numel() * 2 / times[len(times) // 2]  # bytes read + written per second


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bw = copy_bandwidth()
    llm = LLM(a.model, load_format=a.load_format, max_model_len=a.prompt_len + a.new_tokens + 16,
              max_num_seqs=8, enforce_eager=a.enforce_eager)
    arch = llm.config.model.arch
    model = llm.engine.executor.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not arch.tie_word_embeddings:  # an untied embedding table is read one row per token
        weight_bytes -= arch.vocab_size * arch.hidden_size * 2
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    mean_ctx = a.prompt_len + a.new_tokens / 2
    bytes_per_token = weight_bytes + kv_per_token * mean_ctx
    roofline = bw / bytes_per_token
    prompt = random_prompts(1, a.prompt_len, arch.vocab_size)[0]
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stamps = []
    for out in llm.stream(prompt, params):
        torch.cuda.synchronize()
        stamps.append((time.perf_counter(), len(out.outputs[0].token_ids)))
    (t_first, _), (t_last, _) = stamps[0], stamps[-1]
    decode_tok_s = (a.new_tokens - 1) / (t_last - t_first)
    res = {
        "benchmark": "decode_roofline", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                              time.gmtime()),
        "model": a.model, "dtype": llm.config.model.dtype, "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens, "cuda_graphs": not a.enforce_eager,
        "copy_bandwidth_TBps": bw / 1e12, "weight_GB": weight_bytes / 1e9,
        "bytes_per_token_GB": bytes_per_token / 1e9, "roofline_tok_s": roofline,
        "decode_tok_s": decode_tok_s, "fraction_of_roofline": decode_tok_s / roofline,
        "machine": machine_info("cuda"),
    }
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
