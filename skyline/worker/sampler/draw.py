"""A step's random draws: temperature, top-k, top-p, min-p, then the exponential race over what
each row keeps, with noise from a generator keyed by (seed, output index) for a seeded row."""

from __future__ import annotations

import torch

from skyline.ops.nucleus import nucleus_draw
from skyline.worker.sampler.rows import MASK, SamplingRow, seed_for, to_device

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
    probs = sorted_logits.masked_fill(drop, MASK).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    cum = probs.cumsum(-1) - probs
    drop |= cum >= to_device(top_p, probs.dtype, dev)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, MASK)
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
    norm = vals.masked_fill(drop, MASK).logsumexp(-1)
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
    return vals.masked_fill(drop, MASK), ids


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


def sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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
    """`sample_random` of rows of one `_kind` (on the CPU, 2 for all: candidates where they
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
            g.manual_seed(seed_for(r.params.seed, len(r.output_token_ids)))
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
