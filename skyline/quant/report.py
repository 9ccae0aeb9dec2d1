"""The report of a mixed-precision search (`skyline quantize --search`, bench/quant_search.py):
per-layer formats searched for a budget (search.py), then the result and every uniform
candidate format scored on held-out text with their real quantized methods.

The calibration text is split in two: the first `calib_tokens` calibrate the int formats'
clipping and score the search; the next `eval_tokens` (never seen by the search) give the
reported KL, perplexity and top-1 agreement against the unquantized model.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.quant import make_linear_method
from skyline.quant.assignment import Format, assignment_json, parse_budget, stored_bytes
from skyline.quant.base import QuantLinearMethod
from skyline.quant.joint import Choice, linears
from skyline.quant.method import UnquantizedLinearMethod
from skyline.quant.search import SearchResult, prepare, search

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


def assignment_summary(result: SearchResult) -> dict[str, Any]:
    """assignment.json of a search: its size against the budget and every Linear's format."""
    return assignment_json(result.assignment, bytes=result.nbytes, budget_bytes=result.budget,
                           bits_per_weight=8 * result.nbytes / result.num_weights,
                           format_counts=_counts(result.assignment))


def search_budgets(
    model: nn.Module, calib: list[int], evals: list[int], formats: list[Format],
    budgets: list[str], act_sq: dict[str, torch.Tensor] | None, eval_window: int = 512,
    sensitivity_tokens: int = 256, **search_kw: Any,
) -> dict[str, Any]:
    """One search per budget (a format's name: its uniform size; else bits per weight or a
    size, as --budget), sharing the formats' quantization and sensitivities (`prepare`), each
    reported beside the uniform formats on `evals`. The model is left unquantized."""
    cands = prepare(model, calib, formats, act_sq, sensitivity_tokens=sensitivity_tokens)
    held = HeldOut(model, evals, eval_window)
    uniform = [held.row(f"uniform {f.name}", {n: f for n in held.lin}, cands.choices)
               for f in formats]
    held.reset()
    by_name = {r["variant"].removeprefix("uniform "): r["bytes"] for r in uniform}
    runs = []
    for spec in budgets:
        budget = by_name.get(spec) or parse_budget(spec, held.num_weights)
        result = search(model, calib, formats, budget, act_sq, candidates=cands, **search_kw)
        seed = None
        if result.seed != result.assignment:
            seed = held.row("mixed (knapsack seed)", result.seed, cands.choices)
        mixed = held.row("mixed (searched)", result.assignment, cands.choices)
        held.reset()
        report = compare(result, mixed, uniform, seed)
        report["budget"] = spec
        report["assignment"] = {n: f.name for n, f in result.assignment.items()}
        runs.append(report)
    return {"prepare_seconds": round(cands.seconds, 1),
            "search_split_uniform_kl": cands.uniform_kl, "sensitivity": cands.sensitivity,
            "uniform": uniform, "runs": runs}
