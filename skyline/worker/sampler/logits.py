"""What changes a step's logits before a draw, in place: penalties (repetition, presence,
frequency), min_tokens' masked stop tokens, logit biases and structured output's token masks."""

from __future__ import annotations

import numpy as np
import torch

from skyline.worker.sampler.rows import MASK, SamplingRow, to_device


def penalties_of(r: SamplingRow) -> tuple[bool, bool, bool]:
    """Which penalties `apply_penalties` applies to the row: repetition, presence/frequency,
    min_tokens (its stop tokens masked)."""
    p = r.params
    return (p.repetition_penalty != 1.0,
            bool((p.presence_penalty or p.frequency_penalty) and r.output_token_ids),
            bool(p.min_tokens and len(r.output_token_ids) < p.min_tokens and r.stop_ids))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logits [n, vocab], modified in place; only rows that ask for penalties pay for them.
    Each penalty runs over all the rows that ask for it at once, their token ids in one copy
    (a copy and a launch or two a row cost a served step of 256 requests with min_tokens, as
    benchmark clients send it with ignore_eos, ~10 ms on a GPU), and reads and writes the
    logits only at those ids (a pass over [rows, vocab] costs ~0.1 ms at 256 rows of 128k)."""
    dev = logits.device
    repetition: list[int] = []
    counts_based: list[int] = []
    masked: tuple[list[int], list[int]] = ([], [])  # (row, token) of min_tokens' stop tokens
    for i, r in enumerate(rows):
        rep, cnt, min_tokens = penalties_of(r)
        if rep:
            repetition.append(i)
        if cnt:
            counts_based.append(i)
        if min_tokens:
            masked[0].extend([i] * len(r.stop_ids))
            masked[1].extend(r.stop_ids)
    if repetition:
        # a token seen any number of times is penalized once: its repeats write the same value
        at = _occurrences(repetition, [rows[i].history_ids() for i in repetition], dev)
        pen = to_device([rows[i].params.repetition_penalty for i in repetition], logits.dtype,
                        dev)[at[2]]
        vals = logits[at[0], at[1]]
        logits.index_put_((at[0], at[1]), torch.where(vals > 0, vals / pen, vals * pen))
    if counts_based:
        at = _occurrences(counts_based, [rows[i].output_ids() for i in counts_based], dev)
        counts = torch.zeros(len(counts_based), logits.shape[1], dtype=torch.int32, device=dev)
        counts.index_put_((at[2], at[1]), torch.ones(at.shape[1], dtype=torch.int32, device=dev),
                          accumulate=True)
        c = counts[at[2], at[1]].to(logits.dtype)
        freq, pres = to_device([[rows[i].params.frequency_penalty for i in counts_based],
                                [rows[i].params.presence_penalty for i in counts_based]],
                               logits.dtype, dev)[:, at[2]]
        vals = logits[at[0], at[1]]
        logits.index_put_((at[0], at[1]), vals - freq * c - pres * (c > 0).to(logits.dtype))
    if masked[0]:
        idx = to_device(masked, torch.long, dev)
        # the value made on the device: a Python float would be copied from pageable memory,
        # and that copy waits for the device (bench/host_syncs.py)
        logits.index_put_((idx[0], idx[1]), logits.new_full((), MASK))


def _occurrences(row_ids: list[int], ids: list[np.ndarray], device: torch.device
                 ) -> torch.Tensor:
    """[3, total] on the device: for each id of each array, the logits row it belongs to
    (row_ids[k] for ids[k]), the id, and k."""
    lens = np.fromiter(map(len, ids), np.int64, len(ids))
    at = np.empty((3, int(lens.sum())), dtype=np.int64)
    at[2] = np.repeat(np.arange(len(ids)), lens)
    at[0] = np.asarray(row_ids, dtype=np.int64)[at[2]]
    np.concatenate(ids, out=at[1])
    return to_device(at, torch.long, device)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    # logits [n, vocab], modified in place
    for i, r in enumerate(rows):
        if r.bias is None:
            continue
        if r.bias_tensors is None or r.bias_tensors[0].device != logits.device:
            r.bias_tensors = (to_device(list(r.bias), torch.long, logits.device),
                              to_device(list(r.bias.values()), logits.dtype, logits.device))
        logits[i].index_add_(0, *r.bias_tensors)


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
    logits[rows] = sub.masked_fill(allowed == 0, MASK)
