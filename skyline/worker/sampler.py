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

import numpy as np
import torch

from skyline.ops.argmax import argmax
from skyline.ops.nucleus import nucleus_draw
from skyline.types import SamplingParams, TokenLogprobs

_MASK = float("-inf")


@dataclass
class SamplingRow:
    """One row of the batch to sample: the request's params and token history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]  # masked while fewer than min_tokens outputs exist

    def __post_init__(self) -> None:
        self.bias: dict[int, float] | None = self.params.logit_bias or None
        # the biases' token ids and values on the device, made at the first step that needs
        # them (a row lives as long as its request)
        self.bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        # prompt then output ids, as far as the penalties have read them, in a buffer that
        # grows: a step appends its new outputs instead of converting the whole history
        self._ids = np.empty(0, dtype=np.int64)
        self._num_ids = 0
        # steps left that skip `_candidates` after this row's nucleus reached past them
        self.wide_nucleus = 0

    def history_ids(self) -> np.ndarray:
        """The prompt's token ids, then the outputs', as an array (the penalties', each step):
        only outputs new since the last call are converted."""
        p, out = len(self.prompt_token_ids), self.output_token_ids
        n = p + len(out)
        if self._num_ids == 0 or n < self._num_ids or (
                self._num_ids > p and self._ids[self._num_ids - 1] != out[self._num_ids - p - 1]):
            self._num_ids = 0  # first call, or outputs rewritten: start again
        if n > len(self._ids):
            grown = np.empty(max(n, 2 * len(self._ids), 64), dtype=np.int64)
            grown[: self._num_ids] = self._ids[: self._num_ids]
            self._ids = grown
        if self._num_ids < p:
            self._ids[:p] = self.prompt_token_ids
            self._num_ids = p
        if self._num_ids < n:
            self._ids[self._num_ids : n] = out[self._num_ids - p :]
            self._num_ids = n
        return self._ids[:n]

    def output_ids(self) -> np.ndarray:
        return self.history_ids()[len(self.prompt_token_ids) :]


def _seed_for(seed: int, step: int) -> int:
    # Mix (seed, step) into one 63-bit generator seed (splitmix64 finaliser).
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def to_device(values: list[int] | list[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Host values on the device without waiting for them: a pageable copy would synchronise."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _penalties(r: SamplingRow) -> tuple[bool, bool, bool]:
    """Which penalties `_apply_penalties` applies to the row: repetition, presence/frequency,
    min_tokens (its stop tokens masked)."""
    p = r.params
    return (p.repetition_penalty != 1.0,
            bool((p.presence_penalty or p.frequency_penalty) and r.output_token_ids),
            bool(p.min_tokens and len(r.output_token_ids) < p.min_tokens and r.stop_ids))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
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
        rep, cnt, min_tokens = _penalties(r)
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
        logits.index_put_((idx[0], idx[1]), logits.new_full((), _MASK))


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


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    # logits [n, vocab], modified in place
    for i, r in enumerate(rows):
        if r.bias is None:
            continue
        if r.bias_tensors is None or r.bias_tensors[0].device != logits.device:
            r.bias_tensors = (to_device(list(r.bias), torch.long, logits.device),
                              to_device(list(r.bias.values()), logits.dtype, logits.device))
        logits[i].index_add_(0, *r.bias_tensors)


# A step whose rows all keep few tokens (top-k, or a nucleus that on the CPU is checked to lie
# there) sorts only each row's best TOP_CANDIDATES logits and draws among them: a full sort
# and a draw over the vocabulary cost a 16-row CPU step of the default model 34 of its 41 ms.
TOP_CANDIDATES = 1024
# Steps a row whose nucleus reached past the candidates is drawn over the whole vocabulary
# again before it tries them (a flat distribution tends to stay flat: each try costs a top-k
# for nothing).
WIDE_NUCLEUS_SKIP = 16


def _scale(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    temp = to_device([r.params.temperature for r in rows], logits.dtype, logits.device)
    return logits / temp[:, None]


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-k, then top-p over the top-k's own distribution, on temperature-scaled logits
    [n, vocab]: the dropped ones -inf."""
    dev = logits.device
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if not (any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p)):
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    # top_k beyond the vocabulary keeps every token (and must not overflow int64)
    k = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], torch.long, dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, _MASK).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    cum = probs.cumsum(-1) - probs
    drop |= cum >= to_device(top_p, probs.dtype, dev)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def _candidates(logits: torch.Tensor,
                rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_top_k_top_p` over each row's best logits only: (kept logits, the rest -inf; their
    token ids), both [n, m], when every row's kept tokens are among its best TOP_CANDIDATES;
    else None. A row's kept set lies there when its top_k does; a nucleus alone is checked
    on the CPU only (on a GPU the check would wait for the device)."""
    vocab = logits.shape[1]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    limited = [0 < k <= TOP_CANDIDATES for k in top_k]
    if vocab <= TOP_CANDIDATES or not all(lim or p < 1.0 for lim, p in zip(limited, top_p,
                                                                          strict=True)):
        return None
    if not all(limited) and logits.device.type != "cpu":
        return None
    wide = [r for r, lim in zip(rows, limited, strict=True) if not lim and r.wide_nucleus]
    for r in wide:
        r.wide_nucleus -= 1
    if wide:
        return None
    dev = logits.device
    m = max(k if lim else TOP_CANDIDATES for k, lim in zip(top_k, limited, strict=True))
    vals, ids = logits.topk(m, dim=-1)  # sorted, largest first
    k = to_device([k if lim else m for k, lim in zip(top_k, limited, strict=True)], torch.long,
                  dev)
    drop = torch.arange(m, device=dev)[None, :] >= k[:, None]
    # each row's probabilities as the full sort's: over its top-k, or over the vocabulary
    lim = to_device(limited, torch.bool, dev)
    norm = vals.masked_fill(drop, _MASK).logsumexp(-1)
    if not all(limited):
        norm = torch.where(lim, norm, logits.logsumexp(-1))
    probs = (vals - norm[:, None]).exp().masked_fill(drop, 0.0)
    p = to_device(top_p, probs.dtype, dev)
    if not all(limited):  # a nucleus may reach past the candidates (read on the CPU: no wait)
        short = ((~lim) & (probs.sum(-1) < p)).tolist()
        for r, past in zip(rows, short, strict=True):
            if past:
                r.wide_nucleus = WIDE_NUCLEUS_SKIP
        if any(short):
            return None
    drop |= probs.cumsum(-1) - probs >= p[:, None]
    return vals.masked_fill(drop, _MASK), ids


def _min_p(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    min_p = [r.params.min_p for r in rows]
    if not any(m > 0 for m in min_p):
        return probs
    mp = to_device(min_p, probs.dtype, probs.device)
    return probs * (probs >= mp[:, None] * probs.max(-1, keepdim=True).values)


def _nucleus_row(r: SamplingRow, vocab: int) -> bool:
    """Whether a row takes top-p below 1 or min-p, and no top-k below the vocabulary:
    ops/nucleus.py draws it on a GPU without sorting the vocabulary."""
    p = r.params
    return (p.top_p < 1.0 or p.min_p > 0) and (p.top_k <= 0 or p.top_k >= vocab)


def _kind(r: SamplingRow, vocab: int) -> int:
    """A GPU step's rows by how they are drawn: 0 among their best TOP_CANDIDATES logits
    (their top-k lies there), 1 by the nucleus kernel (top-p, min-p), 2 over the sorted
    vocabulary (a wider top-k) or the whole one (temperature alone)."""
    if 0 < r.params.top_k <= TOP_CANDIDATES < vocab:
        return 0
    return 1 if _nucleus_row(r, vocab) else 2


def _by_kind(logits: torch.Tensor) -> bool:
    """Whether rows are drawn by `_kind`: on a GPU (the CPU checks a nucleus against the
    candidates, where reading the check costs no wait)."""
    return logits.is_cuda


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then a draw: [n] token ids. On a GPU, rows that are
    drawn in different ways (`_kind`) are drawn apart, each group its own way."""
    logits = _scale(logits, rows)
    vocab = logits.shape[1]
    if not _by_kind(logits):
        return _sample_group(logits, rows, 2)
    kinds = [_kind(r, vocab) for r in rows]
    if len(set(kinds)) == 1:
        return _sample_group(logits, rows, kinds[0])
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    for kind in sorted(set(kinds)):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        at = to_device(idx, torch.long, logits.device)
        tokens[at] = _sample_group(logits[at], [rows[i] for i in idx], kind)
    return tokens


def _sample_group(logits: torch.Tensor, rows: list[SamplingRow], kind: int) -> torch.Tensor:
    """`_sample_random` of rows of one `_kind` (on the CPU, 2 for all: candidates where they
    hold every row's kept tokens), logits scaled."""
    if kind == 1:
        return _nucleus(logits, rows)
    cand = _candidates(logits, rows)
    if cand is None and all(_nucleus_row(r, logits.shape[1]) for r in rows):
        return _nucleus(logits, rows)  # a CPU step's nucleus past the candidates
    if cand is None:
        return _draw(_min_p(_top_k_top_p(logits, rows).softmax(-1), rows), rows)
    vals, ids = cand
    pick = _draw(_min_p(vals.softmax(-1), rows), rows, ids, logits.shape[1])
    return ids.gather(1, pick[:, None])[:, 0]


def _nucleus(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows of top-p or min-p without top-k, drawn without sorting (ops/nucleus.py)."""
    dev = logits.device
    top_p = to_device([r.params.top_p for r in rows], logits.dtype, dev)
    min_p = [r.params.min_p for r in rows]
    return nucleus_draw(logits, top_p, _noise(logits, rows),
                        to_device(min_p, logits.dtype, dev) if any(min_p) else None)


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


def _draw(probs: torch.Tensor, rows: list[SamplingRow], ids: torch.Tensor | None = None,
          vocab: int = 0) -> torch.Tensor:
    """A draw from each row of probs [n, c] (unnormalized): the column of argmax(p / E)."""
    return (probs / _noise(probs, rows, ids, vocab)).argmax(-1)


def _noise(like: torch.Tensor, rows: list[SamplingRow], ids: torch.Tensor | None = None,
           vocab: int = 0) -> torch.Tensor:
    """E ~ Exp(1) for each element of `like` [n, c]. With `ids` (the token of each column,
    `_candidates`) a seeded row's noise is still drawn for the whole vocabulary and read at
    its tokens, so that its draw does not depend on how many candidates the batch around it
    took."""
    noise = torch.empty_like(like)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if len(unseeded) == len(rows):
        _exponential(noise)
    elif unseeded:
        noise[to_device(unseeded, torch.long, like.device)] = _exponential(torch.empty(
            (len(unseeded), like.shape[1]), device=like.device, dtype=like.dtype))
    for i, r in enumerate(rows):
        if r.params.seed is not None:
            g = torch.Generator(device=like.device)
            g.manual_seed(_seed_for(r.params.seed, len(r.output_token_ids)))
            if ids is None:
                _exponential(noise[i], g)  # in place
            else:
                full = torch.empty(vocab, device=like.device, dtype=like.dtype)
                noise[i] = _exponential(full, g)[ids[i]]
    return noise


def _exponential(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """t filled with Exp(1) draws, and returned. On the CPU as -log(U): torch's exponential_
    there takes ~14 ns an element, a sixth of that for a uniform and a log (10.6 -> 1.7 ms
    for 16 rows of 49k; a U of exactly 0, one in 2^24, gives an infinite E: a token that
    cannot win)."""
    if t.device.type != "cpu":
        return t.exponential_(generator=generator)
    torch.rand(t.shape, generator=generator, dtype=t.dtype, out=t)
    return t.log_().neg_()


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
    penalized = any(any(_penalties(r)) for r in rows)
    if biased or penalized:  # in place, on a copy: logprobs read raw ones
        logits = logits.clone()
    if biased:
        _apply_logit_bias(logits, rows)
    if penalized:
        _apply_penalties(logits, rows)
    tokens = argmax(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) == len(rows):
        tokens = _sample_random(logits, rows)
    elif random_rows:
        sub = [rows[i] for i in random_rows]
        idx = to_device(random_rows, torch.long, dev)
        tokens[idx] = _sample_random(logits[idx], sub)
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
