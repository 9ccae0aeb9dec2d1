"""Top-p (nucleus) and min-p draws without sorting the vocabulary: PyTorch reference, a Triton
kernel (CUDA), and the kernel's rounds in torch ops (the CPU).

A draw is the exponential race of the sampler (worker/sampler/draw.py): the token of
argmax(p / E) over the tokens a row keeps, E ~ Exp(1) given per token. A row keeps its nucleus
(the smallest set of its best tokens whose mass reaches top_p), and of it, with min_p, those
whose probability is at least min_p times the largest. The reference sorts the row: on the H200
the sort of 256 rows of 128k logits costs 3.9 ms, a third of the decode step it ends.

The kernel never sorts. The race's winner over a set that holds the kept tokens is the winner
over the kept tokens when it is one of them (the mass of the tokens above it is below top_p,
its logit at least min-p's floor); and when it lies past the nucleus, every kept token lies
above it. So the kernel races over every token, and while the winner is not kept races again,
with the same noise, over the tokens above the winner (past the nucleus) and at or above the
floor. It returns exactly the token of the race over the kept tokens, after two passes over the
row in its first round (the race fused with the row's max and normalizer, then the mass above
the winner) and two in each later one; the first round wins with the probability of the kept
mass (at least top_p without min-p), each later one removes the tail below a draw from it. One
program per row: ~0.25 ms for 256 rows of 128k on the H200.

Ties: the reference keeps tied logits by the sort's order, the kernel compares with the mass
strictly above; the two differ only when the nucleus' edge falls inside a run of equal logits
(and min-p's floor, compared as logits here and as probabilities there, within a rounding).
"""

from __future__ import annotations

import torch

from skyline import envs
from skyline.ops.triton_utils import tl, triton

BLOCK = 4096  # elements of a row per loop iteration


def nucleus_draw_ref(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor,
                     min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, v] (temperature applied), top_p [n] in (0, 1], noise [n, v] (Exp(1)),
    min_p [n] in [0, 1] or None -> [n] int64: each row's argmax(p / E) over its nucleus (the
    smallest set of its best tokens whose mass reaches top_p, at least one), of which, with
    min_p, the tokens of probability at least min_p times the largest."""
    sorted_logits, idx = logits.float().sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p.to(probs.dtype)[:, None]
    kept = torch.empty_like(sorted_logits).scatter_(1, idx, sorted_logits.masked_fill(
        drop, float("-inf")))
    probs = kept.softmax(-1)
    if min_p is not None:
        top = probs.max(-1, keepdim=True).values
        probs = probs * (probs >= min_p.to(probs.dtype)[:, None] * top)
    return (probs / noise).argmax(-1)


def nucleus_draw(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """nucleus_draw_ref's contract; one Triton launch for CUDA rows, the kernel's rounds in
    torch ops on the CPU."""
    if "nucleus" in envs.ENV.unfuse or logits.dim() != 2 or logits.shape[0] == 0:
        return nucleus_draw_ref(logits, top_p, noise, min_p)  # (the modular form: the sort)
    if logits.device.type == "cpu":
        return nucleus_draw_rounds(logits, top_p, noise, min_p)
    if (triton is None or not logits.is_cuda or logits.stride(-1) != 1
            or noise.stride(-1) != 1):
        return nucleus_draw_ref(logits, top_p, noise, min_p)
    return nucleus_draw_triton(logits, top_p, noise, min_p)


def nucleus_draw_rounds(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor,
                        min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's rounds in torch ops, for the CPU, where reading which rows are done
    costs no wait: each round races the rows not yet done over their tokens above the pivot
    and at or above the floor. A 16-row step of a 49k vocabulary: a few passes over the rows,
    where the sort costs tens of milliseconds on two cores."""
    x = logits.float()
    key = x - noise.float().log()
    m = x.max(-1, keepdim=True).values
    ex = (x - m).exp()
    need = top_p.to(x.dtype) * ex.sum(-1)
    floor = torch.full_like(need, float("-inf"))
    if min_p is not None:  # p >= min_p * p_max: x >= m + log(min_p)
        mp = min_p.to(x.dtype)
        floor = torch.where(mp > 0, m[:, 0] + mp.clamp_min(1e-30).log(), floor)
    out = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    piv = torch.full_like(need, float("-inf"))
    while rows.numel():
        xr = x[rows]
        ok = (xr > piv[:, None]) & (xr >= floor[:, None])
        sel = torch.where(ok, key[rows], float("-inf")).argmax(-1)
        xs = xr.gather(1, sel[:, None])
        above = torch.where(xr > xs, ex[rows], 0.0).sum(-1)
        past = above >= need
        out[rows] = sel
        todo = past | (xs[:, 0] < floor)
        todo &= m[rows, 0] > float("-inf")  # (a row of -inf keeps index 0)
        piv = torch.where(past, xs[:, 0], piv)[todo]
        need, floor, rows = need[todo], floor[todo], rows[todo]
    return out


def nucleus_draw_triton(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor,
                        min_p: torch.Tensor | None = None, block: int = BLOCK,
                        num_warps: int | None = None) -> torch.Tensor:
    """The Triton kernel behind nucleus_draw (any device Triton runs on): one program a row
    (block: elements a loop iteration, num_warps: its warps; a benchmark's choice)."""
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = min(block, triton.next_power_of_2(v))
    top_p = top_p.to(device=logits.device, dtype=torch.float32).contiguous()
    if min_p is not None:
        min_p = min_p.to(device=logits.device, dtype=torch.float32).contiguous()
    _nucleus_kernel[(rows,)](logits, noise, top_p, top_p if min_p is None else min_p, out, v,
                             logits.stride(0), noise.stride(0), MIN_P=min_p is not None,
                             BLOCK=block, ITERS=triton.cdiv(v, block),
                             num_warps=num_warps or (8 if block >= 2048 else 4))
    return out


if triton is not None:

    @triton.jit
    def _first_race(x_row, e_row, V, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # the race over every token (the first of largest x - log(E), i.e. of largest p / E)
        # and its logit, with the row's max logit m and the sum of exp(x - m), in one pass
        offs = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_i = offs
        m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)  # the max so far
        sm = tl.zeros((BLOCK,), tl.float32)  # sum of exp(x - m) per lane
        for i in range(ITERS):
            cols = i * BLOCK + offs
            ok = cols < V
            x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            e = tl.load(e_row + cols, mask=ok, other=1.0).to(tl.float32)
            new = tl.maximum(m, tl.max(x, axis=0))  # one rescale a tile, not an element
            base = tl.where(new == float("-inf"), 0.0, new)  # no -inf - -inf
            sm = sm * tl.exp(m - base) + tl.exp(x - base)
            m = new
            key = tl.where(x > float("-inf"), x - tl.log(e), float("-inf"))
            take = key > best
            best = tl.where(take, key, best)
            best_i = tl.where(take, cols, best_i)
        total = tl.sum(sm, axis=0)
        top = tl.max(best, axis=0)
        sel = tl.min(tl.where(best == top, best_i, V), axis=0)
        return sel, tl.load(x_row + sel).to(tl.float32), m, total

    @triton.jit
    def _race(x_row, e_row, V, piv, floor, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # the race over the tokens with x > piv and x >= floor, and the winner's logit
        offs = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_i = offs
        for i in range(ITERS):
            cols = i * BLOCK + offs
            ok = cols < V
            x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            e = tl.load(e_row + cols, mask=ok, other=1.0).to(tl.float32)
            key = tl.where((x > piv) & (x >= floor), x - tl.log(e), float("-inf"))
            take = key > best
            best = tl.where(take, key, best)
            best_i = tl.where(take, cols, best_i)
        top = tl.max(best, axis=0)
        sel = tl.min(tl.where(best == top, best_i, V), axis=0)
        return sel, tl.load(x_row + sel).to(tl.float32)

    @triton.jit
    def _mass_above(x_row, V, xs, m, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # sum of exp(x - m) over the tokens with x > xs
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(ITERS):
            cols = i * BLOCK + offs
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            acc += tl.where(x > xs, tl.exp(x - m), 0.0)
        return tl.sum(acc, axis=0)

    @triton.jit
    def _nucleus_kernel(x_ptr, e_ptr, p_ptr, minp_ptr, out_ptr, V, stride_x, stride_e,
                        MIN_P: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        e_row = e_ptr + row * stride_e
        sel, xs, m, total = _first_race(x_row, e_row, V, BLOCK, ITERS)
        if m > float("-inf"):  # (a row of -inf keeps the race's 0)
            need = tl.load(p_ptr + row) * total
            if MIN_P:  # p >= min_p * p_max: x >= m + log(min_p)
                min_p = tl.load(minp_ptr + row)
                floor = tl.where(min_p > 0, m + tl.log(tl.maximum(min_p, 1e-30)),
                                 float("-inf"))
            else:
                floor = tl.full((), float("-inf"), tl.float32)
            piv = tl.full((), float("-inf"), tl.float32)
            above = _mass_above(x_row, V, xs, m, BLOCK, ITERS)
            while (above >= need) | (xs < floor):  # not kept: race again over a smaller set
                piv = tl.where(above >= need, xs, piv)  # past the nucleus: only those above
                sel, xs = _race(x_row, e_row, V, piv, floor, BLOCK, ITERS)
                above = _mass_above(x_row, V, xs, m, BLOCK, ITERS)
        tl.store(out_ptr + row, sel.to(tl.int64))
