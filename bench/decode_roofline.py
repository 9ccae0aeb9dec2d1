"""Batch-1 decode against the bandwidth roofline measured in the same run (H200).

  python bench/decode_roofline.py --model llama-3.1-8b --prompt-len 512 --new-tokens 256
  python bench/decode_roofline.py --smoke   # a tiny random model on the CPU: the code only

Roofline: weights + KV bytes read per token over the measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from skyline.bench.floor import copy_bandwidth
from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.bench.smoke import bench_device, tiny_model
from skyline.engine.frontend.llm import LLM
from skyline.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8")
    ap.add_argument("--quantization", default=None, help="weights: fp8 | int8 | int4 | ...")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="the LM head in fp8 (W8A8), with any --quantization")
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, 16 + 8 tokens, on the CPU without a GPU")
    a = ap.parse_args()
    device = bench_device("decode_roofline", a.smoke)
    if a.smoke:
        a.model, a.prompt_len, a.new_tokens = tiny_model(), 16, 8
    bw = copy_bandwidth(torch.device(device))
    llm = LLM(a.model, load_format=a.load_format, max_model_len=a.prompt_len + a.new_tokens + 16,
              max_num_seqs=8, enforce_eager=a.enforce_eager, kv_cache_dtype=a.kv_cache_dtype,
              quantization=a.quantization, quantize_lm_head=a.quantize_lm_head, device=device)
    arch = llm.config.model.arch
    # Every weight a decode step reads, as the layers store them (an fp8 head instead of the
    # dense one), and the K/V bytes of one token.
    cost = llm.query("model_cost")
    weight_bytes = cost.weight_bytes
    mean_ctx = a.prompt_len + a.new_tokens / 2
    bytes_per_token = weight_bytes + cost.kv_bytes_per_token * mean_ctx
    roofline = bw / bytes_per_token
    prompt = random_prompts(1, a.prompt_len, arch.vocab_size)[0]
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))

    def decode_rate() -> float:
        # Time from the first token to the last as the caller receives them (no device syncs
        # of our own: they would stop the engine from overlapping host and device work).
        stamps = [time.perf_counter() for _ in llm.stream(prompt, params)]
        return (a.new_tokens - 1) / (stamps[-1] - stamps[0])

    engine = llm.engine
    by_mode = {}
    for mode in ("off", "on") if engine.async_scheduling else ("off",):
        engine.async_scheduling = mode == "on"
        by_mode[mode] = max(decode_rate() for _ in range(2))
    decode_tok_s = by_mode.get("on", by_mode["off"])
    res = {
        "benchmark": "decode_roofline", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                              time.gmtime()),
        "model": a.model, "dtype": llm.config.model.dtype, "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens, "cuda_graphs": not a.enforce_eager,
        "kv_cache_dtype": llm.config.cache.kv_cache_dtype,
        "quantization": llm.config.model.quant.method,
        "lm_head_fp8": llm.config.model.quant.lm_head,
        "pdl": llm.query("describe")["pdl"],  # programmatic dependent launch (SKYLINE_PDL)
        "copy_bandwidth_TBps": bw / 1e12, "weight_GB": weight_bytes / 1e9,
        "bytes_per_token_GB": bytes_per_token / 1e9, "roofline_tok_s": roofline,
        "decode_tok_s": decode_tok_s, "fraction_of_roofline": decode_tok_s / roofline,
        "decode_tok_s_by_async_scheduling": by_mode,
        "machine": machine_info(device),
    }
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
