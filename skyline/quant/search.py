"""Mixed-precision search: a format per Linear under a size budget, chosen by the end-to-end
KL divergence of the whole quantized model against the unquantized one on calibration text.

Assignments are scored jointly: one layer's rounding error can cancel or amplify another's,
and the KL of a model does not add up over its layers, so the quality of an assignment is
measured (joint.py), not summed from per-layer errors. Per-layer estimates only decide which
assignments are worth measuring:

1. Each Linear is quantized once per candidate format (kept packed, dequantized when swapped
   in), and its output error energy ||f(X) - X W^T||^2 is taken on calibration activations.
2. Sensitivity: the KL with only that Linear quantized (to its middle-sized format) gives its
   gain, KL per unit of error energy; its KL in format f is predicted as gain x energy(f).
   Each format's predictions are then scaled so that they add up to the joint KL of the
   model quantized uniformly to that format (one measurement per format), which absorbs how
   far each format's errors are from adding up.
3. Seed: the assignment minimising the predicted KL within the budget (a multiple-choice
   knapsack, solved by dynamic programming over bytes rounded up, so it always fits).
4. Local search from the best, by joint KL, of the seed and every uniform format that fits:
   moves (one Linear to another format, or one upgraded while another is downgraded to pay
   for it), in order of predicted KL change, each scored by the joint KL of the whole model on
   the search tokens; a move that lowers it (by MIN_GAIN) is kept and the moves are ranked
   again.

The search is deterministic; its cost is about (number of Linears + number of formats)
single-window runs for step 2 and one run of the search tokens per evaluated move, each
starting at the first decoder layer the move touches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from skyline.config import ConfigError
from skyline.progress import bar
from skyline.quant.assignment import Format, check_budget
from skyline.quant.joint import (
    Choice,
    JointKL,
    dequantized,
    linears,
    quantize_choices,
    spread_windows,
    swap_in,
)
from skyline.quant.method import LinearLayer

log = logging.getLogger(__name__)
# A move is kept only if it lowers the joint KL by this fraction: the KL of a few hundred
# tokens is dominated by a few tokens, and smaller gains are mostly fitted to them.
MIN_GAIN = 0.005


@dataclass
class SearchResult:
    assignment: dict[str, Format]  # Linear name -> format
    seed: dict[str, Format]  # the knapsack seed
    nbytes: int  # bytes of the Linears under `assignment` (<= budget)
    budget: int
    num_weights: int  # Linear weight elements (bits per weight = 8 * nbytes / num_weights)
    kl_seed: float  # joint KL of the knapsack seed on the search tokens
    kl: float  # joint KL of `assignment` on the search tokens
    num_evals: int  # joint evaluations of whole assignments (starts and moves)
    seconds: float  # this search, without `prepare`
    moves: list[dict[str, Any]] = field(default_factory=list)  # accepted moves, in order
    # Every Linear quantized to every candidate format (to install without requantizing).
    choices: dict[str, dict[Format, Choice]] = field(default_factory=dict, repr=False)
    start: str = ""  # the starting point of the local search
    starts: dict[str, float] = field(default_factory=dict)  # starting point -> joint KL


@dataclass
class Candidates:
    """Every Linear quantized to every candidate format, with its predicted KL: what a search
    needs besides the budget (several budgets can share it)."""

    formats: list[Format]
    choices: dict[str, dict[Format, Choice]]
    pred: dict[str, dict[Format, float]]  # predicted single-Linear KL, scaled per format
    sensitivity: dict[str, float]  # measured single-Linear KL in its middle-sized format
    uniform_kl: dict[str, float]  # format name -> joint KL of the uniform model (same tokens)
    seconds: float


def prepare(
    model: nn.Module, calib_ids: list[int], formats: list[Format],
    act_sq: dict[str, torch.Tensor] | None = None, sensitivity_tokens: int = 256,
    window: int = 256, energy_tokens: int = 64,
) -> Candidates:
    """Steps 1 and 2 for the unquantized `model`: quantize every Linear to every format
    (`act_sq` from calibrate.py drives the int formats' clipping) and predict each one's KL
    from measurements on `sensitivity_tokens` of `calib_ids`."""
    t0 = time.time()
    choices = quantize_choices(model, formats, act_sq, calib_ids[:energy_tokens])
    lin = linears(model)
    originals = {n: m.linear_method for n, m in lin.items()}
    scorer = JointKL(model, spread_windows(calib_ids, sensitivity_tokens, window))
    pred, sensitivity, uniform_kl = {}, {}, {}
    try:
        for n, layer in bar(lin.items(), desc="measuring sensitivity", unit=" Linears"):
            by_size = sorted(formats, key=lambda f, n=n: choices[n][f].nbytes)
            f0 = by_size[(len(by_size) - 1) // 2]
            layer.linear_method = dequantized(layer, f0, choices[n][f0])
            kl, _ = scorer.score(scorer.block_of[n])
            layer.linear_method = originals[n]
            energy = choices[n][f0].energy
            gain = max(kl, 0.0) / energy if energy > 0 else 0.0
            sensitivity[n] = kl
            pred[n] = {f: gain * c.energy for f, c in choices[n].items()}
        for f in formats:
            if f.method == "none":
                continue
            swap_in(lin, choices, {n: f for n in lin})
            uniform_kl[f.name] = kl = scorer.score(0)[0]
            total = sum(pred[n][f] for n in lin)
            scale = kl / total if total > 0 else 1.0
            for n in lin:
                pred[n][f] *= scale
    finally:
        for n, layer in lin.items():
            layer.linear_method = originals[n]
    log.info("search: %d Linears x %d formats quantized and measured in %.1f s",
             len(lin), len(formats), time.time() - t0)
    return Candidates(formats, choices, pred, sensitivity, uniform_kl, time.time() - t0)


def search(
    model: nn.Module, calib_ids: list[int], formats: list[Format], budget: int,
    act_sq: dict[str, torch.Tensor] | None = None, search_tokens: int = 512,
    window: int = 256, max_evals: int = 64, time_limit: float | None = None,
    candidates: Candidates | None = None, **prepare_kw: Any,
) -> SearchResult:
    """The assignment of `formats` to the Linears of the unquantized, loaded `model` that
    minimises the joint KL on `search_tokens` of `calib_ids` (windows of `window` tokens
    spread over them) with the Linears' bytes <= `budget`. `candidates` (from `prepare`, made
    here when None) may be shared between budgets. `max_evals` / `time_limit` (seconds from
    the start of this call) bound the local search. The model is left as it was."""
    t0 = time.time()
    lin = linears(model)
    num_weights = sum(m.in_features * m.out_features for m in lin.values())
    check_budget(lin, formats, budget)
    windows = spread_windows(calib_ids, search_tokens, window)
    if sum(len(w) for w in windows if len(w) > 1) < 2:
        raise ConfigError("the search needs at least 2 calibration tokens; pass a longer text")
    if candidates is None:
        candidates = prepare(model, calib_ids, formats, act_sq, window=window, **prepare_kw)
    elif candidates.formats != formats:
        raise ValueError("candidates were prepared for other formats")
    choices, pred = candidates.choices, candidates.pred
    originals = {n: m.linear_method for n, m in lin.items()}
    try:
        seed = _seed(pred, choices, formats, budget)
        scorer = JointKL(model, windows)
        starts = [("knapsack seed", seed)] + [
            (f"uniform {f.name}", {n: f for n in lin}) for f in formats
            if sum(choices[n][f].nbytes for n in lin) <= budget]
        best, starts_kl = None, {}
        for label, start in starts:
            swap_in(lin, choices, start)
            kl, token = scorer.score(0)
            starts_kl[label] = kl
            if best is None or kl < best[0]:
                best = (kl, label, start, token)
        assert best is not None
        kl_cur, label, cur, token = best
        swap_in(lin, choices, cur)
        scorer.commit(token)
        log.info("search: starting from %s (KL %.4f on the search tokens)", label, kl_cur)
        deadline = None if time_limit is None else t0 + time_limit
        cur, kl, moves = _local_search(lin, choices, pred, budget, scorer, dict(cur), kl_cur,
                                       max_evals, deadline)
        nbytes = sum(choices[n][f].nbytes for n, f in cur.items())
        assert nbytes <= budget
        return SearchResult(cur, seed, nbytes, budget, num_weights, starts_kl["knapsack seed"],
                            kl, scorer.num_evals, time.time() - t0, moves, choices,
                            start=label, starts=starts_kl)
    finally:
        for n, layer in lin.items():
            layer.linear_method = originals[n]


def solve_knapsack(
    costs: list[list[float]], sizes: list[list[int]], budget: int, resolution: int = 1 << 16
) -> list[int] | None:
    """One option per item minimising the summed cost with summed size <= budget (None if
    nothing fits). Sizes are rounded up to budget/resolution units, so the answer always fits;
    it is optimal up to that rounding."""
    unit = max(1, -(-budget // resolution))
    cap = budget // unit
    inf = float("inf")
    dp = torch.zeros(cap + 1, dtype=torch.float64)  # min cost of items so far within c units
    picks = []
    for cost, size in zip(costs, sizes, strict=True):
        new = torch.full_like(dp, inf)
        pick = torch.zeros(cap + 1, dtype=torch.int16)
        for j, (c, s) in enumerate(zip(cost, size, strict=True)):
            u = -(-s // unit)
            if u > cap:
                continue
            cand = torch.full_like(dp, inf)
            cand[u:] = dp[: cap + 1 - u] + c
            better = cand < new
            new = torch.where(better, cand, new)
            pick = torch.where(better, torch.tensor(j, dtype=torch.int16), pick)
        dp = new
        picks.append(pick)
    if not torch.isfinite(dp[cap]):
        return None
    out, c = [], cap
    for i in range(len(costs) - 1, -1, -1):
        j = int(picks[i][c])
        out.append(j)
        c -= -(-sizes[i][j] // unit)
    return out[::-1]


def _local_search(
    lin: dict[str, LinearLayer], choices: dict[str, dict[Format, Choice]],
    pred: dict[str, dict[Format, float]], budget: int, scorer: JointKL,
    cur: dict[str, Format], kl_cur: float, max_evals: int, deadline: float | None,
) -> tuple[dict[str, Format], float, list[dict[str, Any]]]:
    """First-improvement hill climbing on the joint KL over moves ranked by prediction."""
    moves: list[dict[str, Any]] = []
    ranked = _rank_moves(cur, choices, pred, budget)
    progress = bar(total=max_evals, desc="searching", unit=" moves")
    progress.set_postfix_str(f"best KL {kl_cur:.4f}")
    for _ in range(max_evals):
        if not ranked or (deadline is not None and time.time() > deadline):
            break
        progress.update()
        delta, changes = ranked.pop(0)
        for n, f in changes:
            lin[n].linear_method = dequantized(lin[n], f, choices[n][f])
        kl, token = scorer.score(min(scorer.block_of[n] for n, _ in changes))
        if kl < kl_cur * (1 - MIN_GAIN):
            scorer.commit(token)
            moves.append({"changes": {n: f"{cur[n].name} -> {f.name}" for n, f in changes},
                          "predicted_delta": delta, "kl_before": kl_cur, "kl_after": kl})
            cur.update(changes)
            kl_cur = kl
            progress.set_postfix_str(f"best KL {kl_cur:.4f}")
            ranked = _rank_moves(cur, choices, pred, budget)
        else:
            for n, _ in changes:
                lin[n].linear_method = dequantized(lin[n], cur[n], choices[n][cur[n]])
    progress.close()
    return cur, kl_cur, moves


def _seed(
    pred: dict[str, dict[Format, float]], choices: dict[str, dict[Format, Choice]],
    formats: list[Format], budget: int,
) -> dict[str, Format]:
    """The knapsack optimum of the predicted KL, then the bytes rounding left over spent on
    the upgrades with the most predicted KL saved per byte."""
    names = list(pred)
    picks = solve_knapsack([[pred[n][f] for f in formats] for n in names],
                           [[choices[n][f].nbytes for f in formats] for n in names], budget)
    smallest = {n: min(formats, key=lambda f, n=n: choices[n][f].nbytes) for n in names}
    if picks is None:
        cur = smallest
    else:
        cur = {n: formats[j] for n, j in zip(names, picks, strict=True)}
    left = budget - sum(choices[n][f].nbytes for n, f in cur.items())
    while True:
        best = None
        for n in names:
            for f in formats:
                extra = choices[n][f].nbytes - choices[n][cur[n]].nbytes
                saved = pred[n][cur[n]] - pred[n][f]
                if 0 < extra <= left and saved > 0 and (best is None or saved / extra > best[0]):
                    best = (saved / extra, n, f, extra)
        if best is None:
            return cur
        cur[best[1]] = best[2]
        left -= best[3]


def _rank_moves(
    cur: dict[str, Format], choices: dict[str, dict[Format, Choice]],
    pred: dict[str, dict[Format, float]], budget: int,
) -> list[tuple[float, tuple[tuple[str, Format], ...]]]:
    """Moves within the budget from `cur`, by predicted KL change: one Linear to another
    format, or one Linear up and another down to pay for it."""
    left = budget - sum(choices[n][f].nbytes for n, f in cur.items())
    ups, downs, moves = [], [], []
    for n, f0 in cur.items():
        b0, p0 = choices[n][f0].nbytes, pred[n][f0]
        for f, c in choices[n].items():
            if f == f0:
                continue
            extra, delta = c.nbytes - b0, pred[n][f] - p0
            if extra <= left:
                moves.append((delta, ((n, f),)))
            if extra > 0 and delta < 0:
                ups.append((extra, delta, n, f))
            elif extra < 0:
                downs.append((-extra, delta, n, f))
    downs.sort(key=lambda d: d[1])
    for extra, delta, n, f in ups:
        if extra <= left:
            continue  # a single move already
        for freed, d_delta, m, g in downs:
            if m != n and freed >= extra - left:
                moves.append((delta + d_delta, ((n, f), (m, g))))
    moves.sort(key=lambda m: m[0])
    return moves
