"""The nucleus draw kernel against its sorting reference: the same token for the same noise,
over rows whose first race lands past the nucleus or below min-p's floor (many rounds), ragged
vocabularies, masked tokens, top_p 1 and a row of -inf; and its draws against the kept
tokens' distribution; for the Triton kernel (Triton's interpreter on CPU, the GPU where there
is one) and its rounds in torch ops."""

from __future__ import annotations

import pytest
import torch

from skyline.ops import nucleus as ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _triton(*args):
    pytest.importorskip("triton")
    return ops.nucleus_draw_triton(*args)


# the Triton kernel, and its rounds in torch ops (the CPU's form)
IMPLS = {"triton": _triton, "rounds": ops.nucleus_draw_rounds}


def _case(rows: int, vocab: int, seed: int, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    noise = torch.empty(rows, vocab).exponential_(generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.98 + 0.01
    return logits.to(DEV), top_p.to(DEV), noise.to(DEV)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 7), (4, 1000), (2, 4097), (2, 9000)])
@pytest.mark.parametrize("with_min_p", [False, True])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_reference(rows, vocab, with_min_p, impl):
    for seed in range(3):
        logits, top_p, noise = _case(rows, vocab, seed * 101 + vocab)
        min_p = None
        if with_min_p:  # some rows without (0), some with a floor that binds
            min_p = (torch.arange(rows, device=DEV) % 3) * 0.1
            top_p[0] = 1.0  # min-p alone
        assert torch.equal(IMPLS[impl](logits, top_p, noise, min_p),
                           ops.nucleus_draw_ref(logits, top_p, noise, min_p))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_many_rounds(impl):
    # flat rows and a small nucleus: the race over every token mostly lands past the nucleus,
    # and each round removes only the tail below its winner
    rows, vocab = 16, 3000
    logits, _, noise = _case(rows, vocab, 7, scale=0.3)
    top_p = torch.full((rows,), 0.02, device=DEV)
    want = ops.nucleus_draw_ref(logits, top_p, noise)
    assert torch.equal(IMPLS[impl](logits, top_p, noise), want)
    # the winners differ from the race over the whole row: rounds past the first were taken
    assert (want != (logits.softmax(-1) / noise).argmax(-1)).float().mean() > 0.5


@pytest.mark.parametrize("impl", list(IMPLS))
def test_min_p_floor_rounds(impl):
    # flat rows, a floor that leaves few tokens: the first race mostly lands below it
    rows, vocab = 16, 3000
    logits, _, noise = _case(rows, vocab, 8, scale=1.0)
    top_p = torch.full((rows,), 0.95, device=DEV)
    min_p = torch.full((rows,), 0.5, device=DEV)
    want = ops.nucleus_draw_ref(logits, top_p, noise, min_p)
    assert torch.equal(IMPLS[impl](logits, top_p, noise, min_p), want)
    assert (want != ops.nucleus_draw_ref(logits, top_p, noise)).float().mean() > 0.5


@pytest.mark.parametrize("impl", list(IMPLS))
def test_top_p_one_masked_and_empty_rows(impl):
    logits, _, noise = _case(4, 2000, 3)
    logits[1, ::2] = float("-inf")  # masked tokens never win
    logits[2] = float("-inf")
    logits[2, 1234] = 0.0  # a single allowed token
    logits[3] = float("-inf")  # nothing allowed: index 0, as the reference's argmax of NaN
    top_p = torch.tensor([1.0, 0.5, 0.3, 0.9], device=DEV)
    got = IMPLS[impl](logits, top_p, noise)
    assert torch.equal(got, ops.nucleus_draw_ref(logits, top_p, noise))
    assert got[0] == (logits[0].softmax(-1) / noise[0]).argmax()
    assert got[1] % 2 == 1 and got[2] == 1234 and got[3] == 0


@pytest.mark.parametrize("impl", list(IMPLS))
def test_draws_follow_the_nucleus(impl):
    # one row drawn many times with fresh noise: the frequencies are the nucleus' renormalized
    # probabilities (chi-square, fixed seed)
    probs = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])
    logits = probs.log()
    top_p = 0.75  # keeps 0.30 + 0.25 + 0.15 + 0.12 (0.70 before the fourth)
    # fewer draws where Triton's interpreter runs each row's program in Python
    n = 1500 if impl == "triton" and DEV == "cpu" else 4000
    gen = torch.Generator().manual_seed(5)
    noise = torch.empty(n, probs.numel()).exponential_(generator=gen)
    got = IMPLS[impl](logits.expand(n, -1).contiguous().to(DEV),
                      torch.full((n,), top_p, device=DEV), noise.to(DEV)).cpu()
    counts = torch.bincount(got, minlength=probs.numel()).double()
    assert counts[4:].sum() == 0
    expect = probs[:4].double() / probs[:4].sum() * n
    chi2 = ((counts[:4] - expect) ** 2 / expect).sum().item()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
    # min-p 0.45 of the largest (0.30 * 0.45 = 0.135): of the nucleus 0.12 drops
    got = IMPLS[impl](logits.expand(n, -1).contiguous().to(DEV),
                      torch.full((n,), top_p, device=DEV), noise.to(DEV),
                      torch.full((n,), 0.45, device=DEV)).cpu()
    counts = torch.bincount(got, minlength=probs.numel()).double()
    assert counts[3:].sum() == 0
    expect = probs[:3].double() / probs[:3].sum() * n
    chi2 = ((counts[:3] - expect) ** 2 / expect).sum().item()
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001
