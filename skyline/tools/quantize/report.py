"""`skyline quantize --search`: search per-layer formats for a budget (search.py), then score
the result and every uniform candidate format on held-out text with their real quantized
methods, and write the checkpoint, assignment.json and report.json.

The calibration text is split in two: the first `calib_tokens` calibrate the int formats'
clipping and score the search; the next `eval_tokens` (never seen by the search) give the
reported KL, perplexity and top-1 agreement against the unquantized model.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError, ModelConfig, QuantConfig
from skyline.quant import make_linear_method
from skyline.quant.assignment import (
    Format,
    assignment_json,
    check_budget,
    parse_budget,
    parse_formats,
    stored_bytes,
    to_quant_config,
)
from skyline.quant.base import QuantLinearMethod
from skyline.quant.joint import Choice, linears
from skyline.quant.method import UnquantizedLinearMethod
from skyline.quant.search import SearchResult, search

log = logging.getLogger(__name__)


def install(
    model: nn.Module, assignment: dict[str, Format], choices: dict[str, dict[Format, Choice]],
    ref_weights: dict[str, torch.Tensor],
) -> None:
    """Give every Linear its format's real method and quantized tensors (as quantize_loaded
    would, from the same tensors); `ref_weights` are the unquantized weights ("none")."""
    for name, layer in linears(model).items():
        fmt = assignment[name]
        for pname in [n for n in layer._parameters if n != "bias"]:
            delattr(layer, pname)
        if fmt.method == "none":
            layer.linear_method = UnquantizedLinearMethod()
            layer.weight = nn.Parameter(ref_weights[name], requires_grad=False)
            continue
        method = make_linear_method(fmt.quant_config())
        assert isinstance(method, QuantLinearMethod)
        method.set_tensors(layer, choices[name][fmt].tensors)
        layer.linear_method = method


@torch.no_grad()
def log_probs(model: nn.Module, ids: list[int], window: int) -> list[torch.Tensor]:
    """float32 log-probs [len(w), vocab] of each independent window of `window` tokens."""
    out = []
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[s : s + window])
        if len(chunk) < 2:
            break
        hidden = model(chunk, torch.arange(len(chunk)))
        out.append(model.compute_logits(hidden).float().log_softmax(-1))
    return out


def quality(
    logp: list[torch.Tensor], ref: list[torch.Tensor], ids: list[int], window: int
) -> dict[str, float]:
    """KL(reference || model) per token, perplexity of `ids`, top-1 agreement."""
    nll, kl, agree, n, n_pred = 0.0, 0.0, 0, 0, 0
    for lp, rp, s in zip(logp, ref, range(0, len(ids), window), strict=False):
        targets = torch.tensor(ids[s + 1 : s + len(lp)])
        nll += -lp[:-1].gather(-1, targets[:, None]).sum().item()
        kl += F.kl_div(lp, rp, log_target=True, reduction="sum").item()
        agree += (lp.argmax(-1) == rp.argmax(-1)).sum().item()
        n += len(lp)
        n_pred += len(lp) - 1
    return {"kl": kl / n, "perplexity": float(torch.tensor(nll / n_pred).exp()),
            "top1_agreement": agree / n}


class HeldOut:
    """Scores assignments of an (initially unquantized) model with their real quantized
    methods on held-out token ids, in independent windows, against its unquantized
    outputs."""

    def __init__(self, model: nn.Module, ids: list[int], window: int = 512) -> None:
        self.model, self.ids, self.window = model, ids, window
        self.lin = linears(model)
        self.ref_weights = {n: m.weight.data for n, m in self.lin.items()}
        self.num_weights = sum(m.in_features * m.out_features for m in self.lin.values())
        self.ref = log_probs(model, ids, window)

    def row(
        self, label: str, assignment: dict[str, Format],
        choices: dict[str, dict[Format, Choice]],
    ) -> dict[str, Any]:
        """Install `assignment` and measure it: bytes, bits/weight, KL, perplexity, top-1."""
        install(self.model, assignment, choices, self.ref_weights)
        nbytes = sum(stored_bytes(m) for m in self.lin.values())
        logp = log_probs(self.model, self.ids, self.window)
        row = {"variant": label, "bytes": nbytes, "bits_per_weight": 8 * nbytes / self.num_weights,
               **quality(logp, self.ref, self.ids, self.window)}
        log.info("%s", row)
        return row

    def reset(self) -> None:
        """Back to the unquantized model (what a search starts from)."""
        install(self.model, {n: Format("none") for n in self.lin}, {}, self.ref_weights)


def compare(
    result: SearchResult, mixed: dict[str, Any], uniform: list[dict[str, Any]],
    seed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report of one search: its result beside the uniform formats, the best of those
    that fit the same budget named."""
    budget = result.budget
    assert mixed["bytes"] == result.nbytes <= budget  # the predicted count is the real one
    within = [r for r in uniform if r["bytes"] <= budget]
    larger = [r for r in uniform if r["bytes"] > budget]
    best = min(within, key=lambda r: r["kl"]) if within else None
    return {
        "budget_bytes": budget, "budget_bits_per_weight": 8 * budget / result.num_weights,
        "linear_weights": result.num_weights,
        "search": {"start": result.start, "starts_kl": result.starts,
                   "kl_seed": result.kl_seed, "kl": result.kl,
                   "evaluations": result.num_evals, "seconds": round(result.seconds, 1),
                   "accepted_moves": result.moves},
        "mixed": mixed,
        "mixed_seed": seed,
        "best_uniform_within_budget": best,
        "next_larger_uniform": min(larger, key=lambda r: r["bytes"]) if larger else None,
        "kl_ratio_vs_best_uniform": mixed["kl"] / best["kl"] if best and best["kl"] else None,
        "assignment_counts": _counts(result.assignment),
        "results": [mixed, *([seed] if seed else []), *uniform],
    }


def _counts(assignment: dict[str, Format]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for f in assignment.values():
        counts[f.name] = counts.get(f.name, 0) + 1
    return counts


def search_report(
    model: nn.Module, ids: list[int], formats: list[Format], budget: int,
    act_sq: dict[str, torch.Tensor] | None, calib_tokens: int = 1024, eval_tokens: int = 1024,
    eval_window: int = 512, **search_kw: Any,
) -> tuple[SearchResult, dict[str, Any]]:
    """Search on ids[:calib_tokens], then score the mixed assignment and each uniform format
    on the next `eval_tokens`. Leaves `model` quantized as the mixed assignment."""
    if len(ids) < calib_tokens + 2:
        raise ConfigError(f"the calibration text has {len(ids)} tokens; --search needs more "
                          f"than --calib-tokens ({calib_tokens}) to keep some for evaluation")
    calib, evals = ids[:calib_tokens], ids[calib_tokens : calib_tokens + eval_tokens]
    result = search(model, calib, formats, budget, act_sq, **search_kw)
    t0 = time.time()
    held = HeldOut(model, evals, eval_window)
    uniform = [held.row(f"uniform {f.name}", {n: f for n in held.lin}, result.choices)
               for f in formats]
    seed = None
    if result.seed != result.assignment:
        seed = held.row("mixed (knapsack seed)", result.seed, result.choices)
    mixed = held.row("mixed (searched)", result.assignment, result.choices)  # left installed
    report = compare(result, mixed, uniform, seed)
    report.update({
        "formats": [f.name for f in formats], "calibration_tokens": len(calib),
        "search_tokens": min(len(calib), search_kw.get("search_tokens", 512)),
        "eval_tokens": len(evals), "eval_window": eval_window,
        "eval_seconds": round(time.time() - t0, 1)})
    return result, report


def write_search_outputs(
    model: nn.Module, model_cfg: ModelConfig, result: SearchResult, report: dict[str, Any],
    out_dir: str, calibration: dict[str, Any],
) -> QuantConfig:
    """The checkpoint of the (installed) mixed model, assignment.json and report.json."""
    from skyline.tools.quantize.checkpoint import write_checkpoint

    qcfg = to_quant_config(result.assignment)
    write_checkpoint(model, model_cfg, qcfg, out_dir, calibration)
    out = Path(out_dir)
    meta = {"bytes": result.nbytes, "budget_bytes": result.budget,
            "bits_per_weight": 8 * result.nbytes / result.num_weights,
            "format_counts": _counts(result.assignment)}
    (out / "assignment.json").write_text(
        json.dumps(assignment_json(result.assignment, **meta), indent=2), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return qcfg


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
    from skyline.engine.frontend.llm import load_tokenizer
    from skyline.model.loader import load_model
    from skyline.model.registry import get_model_class
    from skyline.quant.calibrate import builtin_text, collect_act_sq

    if model_cfg.quant.method != "none" or model_cfg.quant.layers:
        raise ConfigError("skyline quantize needs an unquantized model; pass the original one")
    fmts = parse_formats(formats, group_size)
    with torch.device("meta"):  # shapes only: check the budget before loading anything
        shapes = linears(get_model_class(model_cfg.arch.architecture)(model_cfg.arch))
    num_weights = sum(m.in_features * m.out_features for m in shapes.values())
    nbytes = parse_budget(budget, num_weights, shapes, group_size)
    check_budget(shapes, fmts, nbytes)
    tok = load_tokenizer(model_cfg)
    if tok is None:
        raise ConfigError(f"{model_cfg.path} has no tokenizer.json; --search needs one to "
                          "read the calibration text")
    ids = tok.encode(calib_text if calib_text is not None else builtin_text())
    model = load_model(model_cfg, "cpu")
    act_sq = collect_act_sq(model, ids[:calib_tokens])
    result, report = search_report(model, ids, fmts, nbytes, act_sq, calib_tokens, eval_tokens,
                                   **search_kw)
    calibration = {"source": "built-in text" if calib_text is None else "given text",
                   "tokens": min(calib_tokens, len(ids))}
    report = {"model": model_cfg.path, "date": time.strftime("%Y-%m-%d"), **report}
    write_search_outputs(model, model_cfg, result, report, out_dir, calibration)
    return report
