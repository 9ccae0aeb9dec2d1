"""Top-p (nucleus) draws without sorting the vocabulary: PyTorch reference and a Triton kernel
(CUDA).

A draw is the exponential race of the sampler (worker/sampler.py): the token of
argmax(p / E) over the row's nucleus, E ~ Exp(1) given per token. The reference sorts the row,
keeps the smallest prefix whose mass reaches top_p and races over it: on the H200 the sort of
256 rows of 128k logits costs 3.6 ms, a third of the decode step it ends.

The kernel never sorts. The race's winner over the whole row is the winner over the nucleus
when it lies in the nucleus (the mass of the tokens above it is below top_p), and the nucleus
winner always lies above the winner of any larger set; so it races over the tokens above a
pivot, starting below every token, and while the winner falls outside the nucleus raises the
pivot to the winner's logit and races again, with the same noise. It returns exactly the
token of the race over the nucleus (argmax over the nucleus of the same p / E), after two
passes over the row per round and one for the row's normalizer; the first round wins with the
probability of the nucleus' mass (at least top_p), each later one removes the tail below a
draw from it. One program per row: ~0.3 ms for 256 rows of 128k on the H200.

Ties: the reference keeps tied logits by the sort's order, the kernel compares with the mass
strictly above; the two differ only when the nucleus' edge falls inside a run of equal logits.
"""

from __future__ import annotations

import torch

from skyline import envs
from skyline.ops.triton_utils import tl, triton

BLOCK = 4096  # elements of a row per loop iteration


def nucleus_draw_ref(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
                     ) -> torch.Tensor:
    """logits [n, v] (temperature applied), top_p [n] in (0, 1], noise [n, v] (Exp(1)) ->
    [n] int64: each row's argmax(p / E) over its nucleus (the smallest set of its best tokens
    whose mass reaches top_p, at least one)."""
    sorted_logits, idx = logits.float().sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p.to(probs.dtype)[:, None]
    kept = torch.empty_like(sorted_logits).scatter_(1, idx, sorted_logits.masked_fill(
        drop, float("-inf")))
    return (kept.softmax(-1) / noise).argmax(-1)


def nucleus_draw(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
                 ) -> torch.Tensor:
    """nucleus_draw_ref's contract; one Triton launch for CUDA rows."""
    if (triton is None or not logits.is_cuda or logits.dim() != 2 or logits.shape[0] == 0
            or logits.stride(-1) != 1 or noise.stride(-1) != 1
            or "nucleus" in envs.ENV.unfuse):  # (the modular form: the sort)
        return nucleus_draw_ref(logits, top_p, noise)
    return nucleus_draw_triton(logits, top_p, noise)


def nucleus_draw_triton(logits: torch.Tensor, top_p: torch.Tensor, noise: torch.Tensor
                        ) -> torch.Tensor:
    """The Triton kernel behind nucleus_draw (any device Triton runs on): one program a row."""
    rows, v = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = min(BLOCK, triton.next_power_of_2(v))
    top_p = top_p.to(device=logits.device, dtype=torch.float32).contiguous()
    _nucleus_kernel[(rows,)](logits, noise, top_p, out, v, logits.stride(0), noise.stride(0),
                             BLOCK=block, ITERS=triton.cdiv(v, block),
                             num_warps=8 if block >= 2048 else 4)
    return out


if triton is not None:

    @triton.jit
    def _race(x_row, e_row, V, piv, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # the first token of largest x - log(E) (the largest p / E) among those with x > piv,
        # and its logit
        offs = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_i = offs
        for i in range(ITERS):
            cols = i * BLOCK + offs
            ok = cols < V
            x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            e = tl.load(e_row + cols, mask=ok, other=1.0).to(tl.float32)
            key = tl.where(x > piv, x - tl.log(e), float("-inf"))
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
    def _nucleus_kernel(x_ptr, e_ptr, p_ptr, out_ptr, V, stride_x, stride_e,
                        BLOCK: tl.constexpr, ITERS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        e_row = e_ptr + row * stride_e
        # the row's max and sum of exp(x - max), per lane then across lanes
        mx = tl.full((BLOCK,), float("-inf"), tl.float32)
        sm = tl.zeros((BLOCK,), tl.float32)
        for i in range(ITERS):
            cols = i * BLOCK + offs
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            new = tl.maximum(mx, x)
            base = tl.where(new == float("-inf"), 0.0, new)  # no -inf - -inf
            sm = sm * tl.exp(mx - base) + tl.exp(x - base)
            mx = new
        m = tl.max(mx, axis=0)
        total = tl.sum(sm * tl.exp(mx - tl.where(m == float("-inf"), 0.0, m)), axis=0)
        need = tl.load(p_ptr + row) * total
        sel, xs = _race(x_row, e_row, V, float("-inf"), BLOCK, ITERS)
        if m > float("-inf"):  # (a row of -inf keeps the race's 0)
            above = _mass_above(x_row, V, xs, m, BLOCK, ITERS)
            while above >= need:  # the winner lies past the nucleus: race above it
                sel, xs = _race(x_row, e_row, V, xs, BLOCK, ITERS)
                above = _mass_above(x_row, V, xs, m, BLOCK, ITERS)
        tl.store(out_ptr + row, sel.to(tl.int64))
