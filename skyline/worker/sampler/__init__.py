"""Sampling on the device: logit biases, penalties, temperature, min-p, top-k, top-p, seeded
draws, logprobs (of sampled tokens, and of prompt tokens from a prefill pass).

Randomness is drawn as exponential noise: argmax(p / E) with E ~ Exp(1) is a draw from p
(the "exponential race"). A seeded request draws its noise from a generator keyed by
(seed, output index), so its tokens do not depend on the batch around it, on chunking or on
preemption.

Nothing here waits for the device: host values reach it through pinned memory, and the result
stays on the device (`DeviceSample`) until the caller copies it back, so that with async
scheduling the host can prepare the next step while this one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from skyline.ops.argmax import argmax
from skyline.types import TokenLogprobs
from skyline.worker.sampler.draw import sample_random
from skyline.worker.sampler.logits import (
    apply_logit_bias,
    apply_penalties,
    apply_token_masks,
    penalties_of,
)
from skyline.worker.sampler.rows import SamplingRow, to_device

__all__ = ["PROMPT_LOGPROB_ROWS", "DeviceSample", "SamplingRow", "apply_token_masks",
           "prompt_logprobs", "sample", "sample_on_device", "to_device"]


@dataclass
class DeviceSample:
    """A step's sampled tokens (and logprobs) still on the device; `to_host` reads them."""

    tokens: torch.Tensor  # [n] int64
    rows: list[SamplingRow]
    want: list[int] = field(default_factory=list)  # rows that asked for logprobs
    # [w] chosen logprob, [w] rank, [w, k] top logprobs, [w, k] top ids (when `want`)
    logprob_tensors: tuple[torch.Tensor, ...] = ()
    _host: tuple[torch.Tensor, ...] = ()  # tokens, then logprob tensors, on the host
    _event: torch.cuda.Event | None = None

    def copy_to_host(self) -> None:
        """Start the device-to-host copy now (pinned, asynchronous); `to_host` waits for it.
        `tokens` stays on the device: the next step may read it there."""
        if self.tokens.device.type != "cuda":
            return
        self._host = tuple(t.to("cpu", non_blocking=True)
                           for t in (self.tokens, *self.logprob_tensors))
        self._event = torch.cuda.Event()
        self._event.record()

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._event is not None:
            self._event.synchronize()
        host = self._host or (self.tokens, *self.logprob_tensors)
        token_list = host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(self.rows)
        if self.want:
            chosen_lp, ranks, top_lp, top_ids = (t.tolist() for t in host[1:])
            for j, i in enumerate(self.want):
                n = self.rows[i].params.logprobs or 0
                logprobs[i] = TokenLogprobs(
                    token_ids=[token_list[i]] + top_ids[j][:n],
                    logprobs=[chosen_lp[j]] + top_lp[j][:n],
                    sampled_rank=ranks[j],
                )
        return token_list, logprobs


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
    """logits [n, vocab] float32 (one row per request that samples now) -> tokens and
    logprobs on the device, without waiting for it.

    Logprobs are those of the model's raw distribution (before logit biases, penalties and
    temperature), as vLLM reports them.
    """
    dev = logits.device
    raw = logits
    biased = any(r.bias is not None for r in rows)
    penalized = any(any(penalties_of(r)) for r in rows)
    if biased or penalized:  # in place, on a copy: logprobs read raw ones
        logits = logits.clone()
    if biased:
        apply_logit_bias(logits, rows)
    if penalized:
        apply_penalties(logits, rows)
    tokens = argmax(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) == len(rows):
        tokens = sample_random(logits, rows)
    elif random_rows:
        sub = [rows[i] for i in random_rows]
        idx = to_device(random_rows, torch.long, dev)
        tokens[idx] = sample_random(logits[idx], sub)
    out = DeviceSample(tokens, rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        idx = to_device(want, torch.long, dev)
        lp = raw[idx].float().log_softmax(-1)  # [w, vocab]
        chosen = tokens[idx]
        chosen_lp = lp.gather(1, chosen[:, None])  # [w, 1]
        ranks = (lp > chosen_lp).sum(-1) + 1
        k = max(rows[i].params.logprobs or 0 for i in want)
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
        out.want = want
        out.logprob_tensors = (chosen_lp[:, 0], ranks, top_lp, top_ids)
    return out


def sample(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample_on_device`, then wait for the tokens: token ids and logprobs per row."""
    return sample_on_device(logits, rows).to_host()


PROMPT_LOGPROB_ROWS = 512  # logits rows at a time: [rows, vocab] float32 each, not [chunk, vocab]


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Teacher-forced logprobs: row i of `hidden` [n, hidden] scores `targets[i]` (the token
    that follows it in the prompt), with its rank and the top k there. `compute_logits` maps
    hidden rows to [rows, vocab] logits. Waits for the device."""
    out: list[TokenLogprobs] = []
    for s in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        rows = hidden[s : s + PROMPT_LOGPROB_ROWS]
        lp = compute_logits(rows).float().log_softmax(-1)  # [r, vocab]
        tgt = to_device(targets[s : s + len(rows)], torch.long, lp.device)
        chosen = lp.gather(1, tgt[:, None])  # [r, 1]
        ranks = ((lp > chosen).sum(-1) + 1).tolist()
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], tgt[:, None][:, :0])
        for t, c, rank, tl, ti in zip(targets[s : s + len(rows)], chosen[:, 0].tolist(), ranks,
                                      top_lp.tolist(), top_ids.tolist(), strict=True):
            out.append(TokenLogprobs([t, *ti], [c, *tl], rank))
    return out
