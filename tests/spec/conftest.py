"""Shared by the speculative-decoding tests: the target's joint law of two sampled tokens and a
chi-square check that outputs follow it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch


def _pair_law(llm, prompt: list[int], k: int = 3) -> tuple[list[tuple[int, int]], list[float]]:
    """The target's law of its first two tokens (t1, t2) after `prompt` under top-k `k`."""
    top1 = llm.score(prompt)[0][-1].topk(k)
    cells, probs = [], []
    for a, pa in zip(top1.indices.tolist(), top1.values.softmax(-1).tolist(), strict=True):
        nxt = llm.score(prompt + [a])[0][-1].topk(k)
        for b, pb in zip(nxt.indices.tolist(), nxt.values.softmax(-1).tolist(), strict=True):
            cells.append((a, b))
            probs.append(pa * pb)
    return cells, probs


def _assert_pairs_follow(outs: list[list[int]], cells: list[tuple[int, int]],
                         probs: list[float]) -> None:
    """The first two tokens of `outs` never leave `cells` and pass a chi-square test (about
    4.5 sigma) against `probs`."""
    n = len(outs)
    seen = [(o[0], o[1]) for o in outs]
    assert set(seen) <= set(cells), "emitted a pair the target excludes"
    counts = torch.tensor([seen.count(c) for c in cells], dtype=torch.float64)
    exp = torch.tensor(probs, dtype=torch.float64) * n
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    dof = len(cells) - 1
    assert chi2 < dof + 4.5 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.fixture
def pair_law():
    return SimpleNamespace(law=_pair_law, check=_assert_pairs_follow)
