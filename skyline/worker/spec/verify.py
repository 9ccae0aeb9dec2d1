"""Verification of draft tokens: one target forward pass scores every draft position, then
rejection sampling decides how many drafts each request keeps.

For a draft that is a point mass on token x (n-gram, suffix), standard speculative sampling
accepts x with probability p(x) and on rejection draws from p with x removed and renormalised.
We realise exactly that by coupling: at each position j the target distribution p_j (after
penalties, temperature, top-k/top-p/min-p, given the drafts before j as accepted output) is
sampled with the sampler's usual exponential race, whose noise for a seeded request is keyed by
(seed, output index). The draft is accepted iff the race picks it — probability p_j(x) — and
otherwise the race's winner, distributed as p_j conditioned on "not x", is the correction.
After k accepted drafts the race at position k is the bonus token. Hence:
- greedy: accept while the draft equals the argmax, then the argmax;
- the output follows the target distribution exactly, and a seeded request emits the very tokens
  it would emit without speculation (deterministic whatever the drafts or the batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from skyline.types import TokenLogprobs
from skyline.worker.inputs import RequestState
from skyline.worker.sampler import SamplingRow, apply_token_masks, sample


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


def verify_rows(
    states: Sequence[RequestState],
    drafts: Sequence[Sequence[int]],
    stop_ids: Sequence[tuple[int, ...]],
) -> list[SamplingRow]:
    """One sampling row per scored position: request i has len(drafts[i]) + 1 rows, row j
    seeing the drafts before j as output (penalties, min_tokens and the seed's output index
    follow)."""
    rows = []
    for s, d, stop in zip(states, drafts, stop_ids, strict=True):
        rows.append(SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, stop))
        for j in range(1, len(d) + 1):
            rows.append(SamplingRow(s.params, s.prompt_token_ids,
                                    s.output_token_ids + list(d[:j]), stop))
    return rows


def sample_and_verify(
    logits: torch.Tensor,  # [sum(len(d) + 1 for d in drafts), vocab]
    rows: list[SamplingRow],  # from verify_rows
    drafts: Sequence[Sequence[int]],
    masks: Sequence[bytes | None] = (),  # structured output: for each request's first row only
) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Tokens each request emits this step (accepted drafts, then the correction or bonus
    token) and their logprobs (None where the request asked for none)."""
    if any(m is not None for m in masks):
        first, row_masks = 0, [None] * len(rows)
        for d, m in zip(drafts, masks, strict=True):
            row_masks[first] = m
            first += len(d) + 1
        apply_token_masks(logits, row_masks)
    tokens, lps = sample(logits, rows)
    out_tokens: list[list[int]] = []
    out_lps: list[list[TokenLogprobs] | None] = []
    r = 0
    for d in drafts:
        k = len(d)
        targets = tokens[r : r + k + 1]
        a = num_accepted(d, targets)
        out_tokens.append(targets[: a + 1])
        out_lps.append(lps[r : r + a + 1] if lps[r] is not None else None)
        r += k + 1
    return out_tokens, out_lps
