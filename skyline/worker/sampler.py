"""Sampling on the device: penalties, temperature, min-p, top-k, top-p, seeded draws, logprobs.

Randomness is drawn as exponential noise: argmax(p / E) with E ~ Exp(1) is a draw from p
(the "exponential race"). A seeded request draws its noise from a generator keyed by
(seed, output index), so its tokens do not depend on the batch around it, on chunking or on
preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skyline.types import SamplingParams, TokenLogprobs

_MASK = float("-inf")


@dataclass
class SamplingRow:
    """One row of the batch to sample: the request's params and token history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]  # masked while fewer than min_tokens outputs exist


def _seed_for(seed: int, step: int) -> int:
    # Mix (seed, step) into one 63-bit generator seed (splitmix64 finaliser).
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    # logits [n, vocab], modified in place; only rows that ask for penalties pay for them.
    vocab = logits.shape[1]
    dev = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(r.prompt_token_ids + r.output_token_ids, device=dev).unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids, device=dev), minlength=vocab)
            logits[i] -= p.frequency_penalty * counts[:vocab].to(logits.dtype)
            logits[i] -= p.presence_penalty * (counts[:vocab] > 0).to(logits.dtype)
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens and r.stop_ids:
            logits[i, list(r.stop_ids)] = _MASK


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p on the non-greedy rows; returns probabilities."""
    dev = logits.device
    temp = torch.tensor([r.params.temperature for r in rows], device=dev, dtype=logits.dtype)
    logits = logits / temp[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(drop, _MASK).softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        cum = probs.cumsum(-1) - probs
        drop |= cum >= torch.tensor(top_p, device=dev, dtype=probs.dtype)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    probs = logits.softmax(-1)
    if any(m > 0 for m in min_p):
        mp = torch.tensor(min_p, device=dev, dtype=probs.dtype)
        keep = probs >= mp[:, None] * probs.max(-1, keepdim=True).values
        probs = probs * keep
    return probs


def apply_token_masks(logits: torch.Tensor, masks: list[bytes | None]) -> None:
    """Structured output: disallow, in place, every token whose bit is 0 in the row's bitmask.

    logits [n, vocab]; masks[i] is None (row unconstrained) or ceil(vocab / 32) little-endian
    int32 words where bit i of word j allows token 32 * j + i (llguidance's layout)."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return
    words = torch.stack([torch.frombuffer(bytearray(masks[i]), dtype=torch.int32) for i in rows])
    words = words.to(logits.device)  # [r, ceil(vocab / 32)]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> bits) & 1).flatten(1)[:, : logits.shape[1]]  # [r, vocab]
    if allowed.shape[1] < logits.shape[1]:  # a short mask disallows the tokens it omits
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
    sub = logits[rows]
    logits[rows] = sub.masked_fill(allowed == 0, _MASK)


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(
            (len(unseeded), probs.shape[1]), device=probs.device, dtype=probs.dtype
        ).exponential_()
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            g = torch.Generator(device=probs.device)
            g.manual_seed(_seed_for(r.params.seed, len(r.output_token_ids)))
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(-1)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [n, vocab] float32 (one row per request that samples now) -> token ids, logprobs.

    Logprobs are those of the model's raw distribution (before penalties and temperature),
    as vLLM reports them.
    """
    raw = logits
    logits = logits.clone()
    _apply_penalties(logits, rows)
    tokens = logits.argmax(-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        sub = [rows[i] for i in random_rows]
        probs = _filter(logits[random_rows], sub)
        tokens[random_rows] = _draw(probs, sub)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = raw[want].float().log_softmax(-1)  # [w, vocab]
        chosen = tokens[want]
        chosen_lp = lp.gather(1, chosen[:, None])  # [w, 1]
        ranks = (lp > chosen_lp).sum(-1) + 1
        k = max(rows[i].params.logprobs or 0 for i in want)
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
        chosen_lp, ranks = chosen_lp[:, 0].tolist(), ranks.tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(want):
            n = rows[i].params.logprobs or 0
            logprobs[i] = TokenLogprobs(
                token_ids=[token_list[i]] + top_ids[j][:n],
                logprobs=[chosen_lp[j]] + top_lp[j][:n],
                sampled_rank=ranks[j],
            )
    return token_list, logprobs
