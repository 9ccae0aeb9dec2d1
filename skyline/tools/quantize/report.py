"""`skyline quantize --search`: search per-layer formats for a budget, then score the result
and every uniform candidate format on held-out text with their real quantized methods
(quant/report.py, the `search_formats` query), and write the checkpoint, assignment.json and
report.json.

The calibration text is split in two: the first `calib_tokens` calibrate the int formats'
clipping and score the search; the next `eval_tokens` (never seen by the search) give the
reported KL, perplexity and top-1 agreement against the unquantized model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from skyline.config import ConfigError, ModelConfig
from skyline.engine.cost import format_budget
from skyline.tools import builtin_text
from skyline.tools.quantize.checkpoint import load_for_tools, save


def table(report: dict[str, Any]) -> str:
    """The report as a short markdown table (mixed first, then every uniform format)."""
    best = report["best_uniform_within_budget"]
    lines = ["| variant | bits/weight | MiB | KL | perplexity | top-1 |",
             "|---|---|---|---|---|---|"]
    for r in sorted(report["results"], key=lambda r: (not r["variant"].startswith("mixed"),
                                                      r["bytes"])):
        mark = " (best uniform within budget)" if best and r is best else ""
        lines.append(f"| {r['variant']}{mark} | {r['bits_per_weight']:.3f} | "
                     f"{r['bytes'] / 2**20:.2f} | {r['kl']:.4f} | {r['perplexity']:.3f} | "
                     f"{r['top1_agreement']:.3f} |")
    ratio = report["kl_ratio_vs_best_uniform"]
    if ratio is not None:
        lines.append(f"KL of the mixed assignment / best uniform within the budget: {ratio:.3f}")
    return "\n".join(lines)


def search_checkpoint(
    model_cfg: ModelConfig, formats: str, budget: str, out_dir: str, group_size: int = 128,
    calib_text: str | None = None, calib_tokens: int = 1024, eval_tokens: int = 1024,
    **search_kw: Any,
) -> dict[str, Any]:
    """`skyline quantize --search`: load the unquantized `model_cfg`, search formats (a
    comma-separated list) for `budget` ("4.5" bits per weight, "70MiB", or a format name for
    that format's uniform size), score on held-out text, write `out_dir`. Returns the
    report."""
    if model_cfg.quant.method != "none" or model_cfg.quant.layers:
        raise ConfigError("skyline quantize needs an unquantized model; pass the original one")
    nbytes = format_budget(model_cfg.arch, formats, budget, group_size)  # before loading
    llm = load_for_tools(model_cfg)
    try:
        if llm.tokenizer is None:
            raise ConfigError(f"{model_cfg.path} has no tokenizer.json; --search needs one to "
                              "read the calibration text")
        ids = llm.tokenizer.encode(calib_text if calib_text is not None else builtin_text())
        act_sq = llm.query("collect_act_sq", ids[:calib_tokens])
        found = llm.query("search_formats", formats, group_size, nbytes, ids, act_sq,
                          calib_tokens, eval_tokens, search_kw)
        calibration = {"source": "built-in text" if calib_text is None else "given text",
                       "tokens": min(calib_tokens, len(ids))}
        report = {"model": model_cfg.path, "date": time.strftime("%Y-%m-%d"), **found["report"]}
        save(llm, model_cfg, found["quant"], out_dir, calibration)
    finally:
        llm.shutdown()
    out = Path(out_dir)
    (out / "assignment.json").write_text(json.dumps(found["assignment"], indent=2),
                                         encoding="utf-8")
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
