"""Batch-1 decode against the bandwidth roofline measured in the same run (H200).

  python bench/decode_roofline.py --model llama-3.1-8b --prompt-len 512 --new-tokens 256

Roofline: weights + KV bytes read per token over the measured device-to-device copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from skyline.bench.floor import copy_bandwidth
from skyline.bench.offline import machine_info, random_prompts, save_json
from skyline.engine.frontend.llm import LLM
from skyline.model.layers.embedding import LMHead
from skyline.model.layers.linear import Linear
from skyline.model.weights import held_bytes
from skyline.ops.pdl import use_pdl
from skyline.quant import fp8, intq
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
    ap.add_argument("--fp8-gemv", default=None, choices=["a8p", "a8", "a8q", "w8a16"],
                    help="fp8 weights at <= 8 rows: fp8 x fp8 tensor-core GEMV with x quantized "
                         "by the norm / SiLU kernel that makes it (a8p, default), in the GEMV "
                         "(a8) or by its own kernel first (a8q); or weight-only (w8a16)")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="the LM head in fp8 (W8A8), with any --quantization")
    ap.add_argument("--int4-gemv", default=None, choices=["a16", "a8", "a8p"],
                    help="int4 weights at <= 8 rows: weight-only tensor-core GEMV (a16) or "
                         "W4A8 by dp4a with x rounded to int8 per 32 columns, by the norm / "
                         "SiLU kernels that make it (a8p, default) or by a launch of its own "
                         "before every GEMV (a8)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.int4_gemv is not None:
        intq.INT4_GEMV = a.int4_gemv
    if a.fp8_gemv is not None:
        fp8.GEMV_ACTIVATIONS = a.fp8_gemv
    bw = copy_bandwidth(torch.device("cuda"))
    llm = LLM(a.model, load_format=a.load_format, max_model_len=a.prompt_len + a.new_tokens + 16,
              max_num_seqs=8, enforce_eager=a.enforce_eager, kv_cache_dtype=a.kv_cache_dtype,
              quantization=a.quantization, quantize_lm_head=a.quantize_lm_head)
    arch = llm.config.model.arch
    model = llm.engine.executor.runner.model
    # Every tensor a Linear layer holds (packed quantized weights, scales, the layouts its
    # kernels serve from), plus the other modules' parameters (embedding, norms, LM head).
    others = {id(p): p for m in model.modules() if not isinstance(m, Linear)
              for p in m.parameters(recurse=False)}
    weight_bytes = held_bytes(m for m in model.modules() if isinstance(m, Linear)) + sum(
        p.numel() * p.element_size() for p in others.values())
    if not arch.tie_word_embeddings:  # an untied embedding table is read one row per token
        weight_bytes -= arch.vocab_size * arch.hidden_size * 2
    for m in model.modules():  # an fp8 head is read instead of the dense one
        if isinstance(m, LMHead) and m.fp8_weight is not None:
            weight_bytes += sum(t.numel() * t.element_size() for t in (m.fp8_weight, m.fp8_scale))
            weight_bytes -= m.weight.numel() * m.weight.element_size()
    kv_elem = 1 if llm.config.cache.kv_cache_dtype == "fp8_e4m3" else 2
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * kv_elem
    mean_ctx = a.prompt_len + a.new_tokens / 2
    bytes_per_token = weight_bytes + kv_per_token * mean_ctx
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
        "quantization": llm.config.model.quant.method, "fp8_gemv": fp8.GEMV_ACTIVATIONS,
        "int4_gemv": intq.INT4_GEMV,
        "lm_head_fp8": llm.config.model.quant.lm_head,
        "pdl": use_pdl(torch.device("cuda")),  # programmatic dependent launch (SKYLINE_PDL)
        "copy_bandwidth_TBps": bw / 1e12, "weight_GB": weight_bytes / 1e9,
        "bytes_per_token_GB": bytes_per_token / 1e9, "roofline_tok_s": roofline,
        "decode_tok_s": decode_tok_s, "fraction_of_roofline": decode_tok_s / roofline,
        "decode_tok_s_by_async_scheduling": by_mode,
        "machine": machine_info("cuda"),
    }
    print(json.dumps(res, indent=1))
    save_json(res, a.out)


if __name__ == "__main__":
    main()
