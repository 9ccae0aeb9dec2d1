from __future__ import annotations

import math

import pytest
import torch

from skyline.types import SamplingParams
from skyline.worker.sampler import SamplingRow, sample
from skyline.worker.sampler import draw as sampler


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2, 3], [], ())


def _expected_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: the filtered distribution, computed independently with plain loops."""
    x = (logits / p.temperature).double()
    order = sorted(range(len(x)), key=lambda i: -x[i].item())
    keep = set(order[: p.top_k] if p.top_k else order)
    probs = x.softmax(-1)
    if p.top_p < 1:
        mass, kept = 0.0, set()
        sub = torch.tensor([x[i].item() if i in keep else -math.inf for i in range(len(x))])
        sp = sub.softmax(-1)
        for i in order:
            if i not in keep:
                continue
            kept.add(i)
            mass += sp[i].item()
            if mass >= p.top_p:
                break
        keep = kept
    masked = torch.tensor([probs[i].item() if i in keep else 0.0 for i in range(len(x))])
    masked = masked / masked.sum()
    if p.min_p > 0:
        masked = torch.where(masked >= p.min_p * masked.max(), masked, 0.0)
        masked = masked / masked.sum()
    return masked


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=6, top_p=0.9),
    dict(temperature=0.9, top_k=3, top_p=0.95, min_p=0.05),
])
@pytest.mark.parametrize("candidates", [1024, 4])  # the full sort; the best 4 logits first
def test_sampling_distribution_matches(kw, candidates, monkeypatch):
    """Chi-square goodness of fit of 20k draws against the filtered softmax."""
    monkeypatch.setattr(sampler, "TOP_CANDIDATES", candidates)
    _assert_draws_fit(SamplingParams(**kw), 20000)


def _assert_draws_fit(params: SamplingParams, n: int, device: str = "cpu") -> None:
    """n draws from one row of 12 logits on `device` against the filtered softmax."""
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(vocab) * 1.5
    rows = [SamplingRow(params, [0], [], ()) for _ in range(n)]
    tokens, _ = sample(logits.repeat(n, 1).to(device), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    exp = _expected_probs(logits, params) * n
    assert counts[exp == 0].sum() == 0, "sampled a token the filters exclude"
    nz = exp > 0
    chi2 = (((counts[nz] - exp[nz]) ** 2) / exp[nz]).sum().item()
    dof = int(nz.sum()) - 1
    # p < 1e-4 critical value is about dof + 4.5*sqrt(2*dof) + 10 for these small dof
    assert chi2 < dof + 4.5 * math.sqrt(2 * max(dof, 1)) + 10, (chi2, dof)


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, lps = sample(logits, [_row(temperature=0.0, logprobs=2)])
    assert tokens == [1]
    lp = lps[0]
    ref = logits.log_softmax(-1)[0]
    assert lp.token_ids == [1, 1, 3] and lp.sampled_rank == 1
    assert lp.logprobs == pytest.approx([ref[1].item(), ref[1].item(), ref[3].item()])


def test_seeded_rows_ignore_batch():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    p_seed = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[i:i + 1], [SamplingRow(p_seed, [0], [], ())])[0][0] for i in range(6)]
    rows = [SamplingRow(p_seed, [0], [], ()) if i % 2 == 0 else _row(temperature=1.0)
            for i in range(6)]
    batched, _ = sample(logits, rows)
    assert [batched[i] for i in (0, 2, 4)] == [alone[i] for i in (0, 2, 4)]


def test_seeded_rows_differ_by_step():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    draws = {sample(logits, [SamplingRow(p, [0], [0] * k, ())])[0][0] for k in range(20)}
    assert len(draws) > 10


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    # repetition penalty on a token in the prompt turns the tie into a choice
    row = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [], ())
    assert sample(logits, [row])[0] == [1]
    # frequency penalty scales with occurrences in the output only
    row = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), [], [1, 1], ())
    assert sample(logits, [row])[0] == [0]
    row = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.5), [], [0], ())
    assert sample(logits, [row])[0] == [1]


def _penalized_row_by_row(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Reference: each row's penalties alone, in the order repetition, counts, min_tokens."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p, x = r.params, out[i]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[r.prompt_token_ids + r.output_token_ids] = True
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty,
                                              x * p.repetition_penalty), x)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            counts = torch.bincount(torch.tensor(r.output_token_ids), minlength=len(x)).float()
            x = x - p.frequency_penalty * counts
            x = x - p.presence_penalty * (counts > 0).float()
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens and r.stop_ids:
            x = x.clone()
            x[list(r.stop_ids)] = -math.inf
        out[i] = x
    return out


def test_penalties_of_a_batch_match_each_row_alone():
    from skyline.worker.sampler.logits import apply_penalties

    g = torch.Generator().manual_seed(0)
    vocab = 50
    rows = []
    for i in range(12):
        kw = {"temperature": 0.0}
        if i % 2:
            kw["repetition_penalty"] = 1.0 + 0.1 * i
        if i % 3 == 0:
            kw["frequency_penalty"], kw["presence_penalty"] = 0.25 * i, 0.5
        if i % 4 == 1:
            kw["min_tokens"] = 5
        prompt = torch.randint(0, vocab, (i + 1,), generator=g).tolist()
        output = torch.randint(0, vocab, (i % 6,), generator=g).tolist()
        rows.append(SamplingRow(SamplingParams(**kw), prompt, output, (0, 7)))
    logits = torch.randn(len(rows), vocab, generator=g)
    got = logits.clone()
    apply_penalties(got, rows)
    assert torch.equal(got, _penalized_row_by_row(logits, rows))
    assert not torch.equal(got, logits)


def test_min_tokens_masks_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), [], [], (0,))
    assert sample(logits, [row])[0] == [1]
    row = SamplingRow(SamplingParams(temperature=0.0, min_tokens=2), [], [1, 1], (0,))
    assert sample(logits, [row])[0] == [0]


def test_logit_bias_forces_and_bans():
    """+100 makes a token the draw (at temperature 1, 2,000 rows of a peaked distribution);
    -100 bans the favourite; other rows of the batch are unbiased; logprobs stay raw."""
    torch.manual_seed(3)
    n, vocab = 2000, 64
    logits = (torch.randn(vocab) * 4).repeat(n, 1)
    top, low = int(logits[0].argmax()), int(logits[0].argmin())
    force = SamplingParams(temperature=1.0, logit_bias={low: 100.0}, logprobs=0)
    ban = SamplingParams(temperature=1.0, logit_bias={top: -100.0})
    rows = [SamplingRow(force if i % 3 == 0 else ban if i % 3 == 1 else SamplingParams(),
                        [0], [], ()) for i in range(n)]
    tokens, lps = sample(logits, rows)
    assert all(t == low for t in tokens[0::3])
    assert top not in tokens[1::3]
    assert tokens[2::3].count(top) > 0  # unbiased rows still draw the favourite
    raw = logits[0].log_softmax(-1)
    assert lps[0].token_ids == [low] and lps[0].logprobs[0] == pytest.approx(raw[low].item())
    greedy = [SamplingRow(SamplingParams(temperature=0.0, logit_bias={top: -100, low: 100}),
                          [0], [], ())]
    assert sample(logits[:1], greedy)[0] == [low]


def test_logit_bias_bounds():
    with pytest.raises(ValueError, match="between -100 and 100"):
        SamplingParams(logit_bias={1: 101.0}).validate()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(logit_bias={64: 1.0}).validate(64)
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={-1: 1.0}).validate()
    with pytest.raises(ValueError, match="between -100 and 100"):
        SamplingParams(logit_bias={1: float("nan")}).validate()


def test_history_ids_follow_the_outputs_as_they_grow():
    from skyline.worker.sampler import SamplingRow

    out: list[int] = []
    row = SamplingRow(SamplingParams(repetition_penalty=1.2), [5, 6, 7], out, ())
    assert row.history_ids().tolist() == [5, 6, 7] and row.output_ids().tolist() == []
    for t in range(100):  # past the buffer's first size
        out.append(t)
        assert row.history_ids().tolist() == [5, 6, 7, *range(t + 1)]
    out[-1] = 1000  # rewritten in place: read again
    assert row.output_ids().tolist() == [*range(99), 1000]
    del out[50:]
    assert row.output_ids().tolist() == list(range(50))


def _rows(kws: list[dict], seed_base: int | None = None) -> list[SamplingRow]:
    return [SamplingRow(SamplingParams(**kw, seed=None if seed_base is None else seed_base + i),
                        [0], [], ()) for i, kw in enumerate(kws)]


ROW_PARAMS = [dict(temperature=0.7, top_k=40), dict(temperature=1.0, top_p=0.9),
              dict(temperature=1.3, top_k=300, top_p=0.5), dict(temperature=0.5, top_p=0.99),
              dict(temperature=1.0, top_k=1)]


def test_candidates_keep_what_the_full_sort_keeps():
    torch.manual_seed(4)
    logits = torch.randn(len(ROW_PARAMS), 5000, dtype=torch.float64) * 4
    rows = _rows(ROW_PARAMS)
    scaled = sampler._scale(logits, rows)
    full = sampler._top_k_top_p(scaled, rows)
    vals, ids = sampler._candidates(scaled, rows)
    back = torch.full_like(full, -math.inf).scatter_(1, ids, vals)
    assert torch.equal(back.isinf(), full.isinf())
    kept = ~full.isinf()
    torch.testing.assert_close(back[kept], full[kept])
    # a nucleus wider than the candidates: the full sort
    flat = _rows([dict(temperature=50.0, top_p=0.99)])
    assert sampler._candidates(sampler._scale(logits[:1], flat), flat) is None
    # ... and that row sorts everything for a while before it tries the candidates again
    peaked = sampler._scale(logits[:1] * 100, flat)
    for left in range(sampler.WIDE_NUCLEUS_SKIP - 1, -1, -1):
        assert sampler._candidates(peaked, flat) is None and flat[0].wide_nucleus == left
    assert sampler._candidates(peaked, flat) is not None
    # a row that keeps everything: the full sort
    assert sampler._candidates(scaled, rows + _rows([dict(temperature=1.0)])) is None


def test_seeded_rows_draw_the_same_token_from_candidates(monkeypatch):
    torch.manual_seed(5)
    logits = torch.randn(len(ROW_PARAMS), 3000) * 3
    for step in range(20):
        rows = _rows(ROW_PARAMS, seed_base=100 * step)
        assert sampler._candidates(sampler._scale(logits, rows), rows) is not None
        got = sample(logits, rows)[0]
        monkeypatch.setattr(sampler, "TOP_CANDIDATES", 1 << 20)  # the full sort
        want = sample(logits, rows)[0]
        monkeypatch.undo()
        assert got == want


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel_path(monkeypatch):
    """Rows drawn by kind, the nucleus kernel among them, as on a GPU step (without a GPU, the
    kernel in Triton's interpreter)."""
    pytest.importorskip("triton")
    if DEV == "cuda":
        return
    from skyline.ops.nucleus import nucleus_draw_triton

    monkeypatch.setattr(sampler, "_by_kind", lambda logits: True)
    monkeypatch.setattr(sampler, "nucleus_draw", nucleus_draw_triton)


MIXED_ROWS = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.5, top_p=0.99),
              dict(temperature=1.3, top_p=0.3, top_k=100_000), dict(temperature=0.8),
              dict(temperature=0.7, top_k=40), dict(temperature=1.0, top_k=300, top_p=0.5),
              dict(temperature=1.0, top_p=0.8, min_p=0.05), dict(temperature=0.9, top_p=0.7)]


def test_rows_drawn_by_kind_draw_the_full_sort_tokens(monkeypatch):
    """Seeded rows: drawn by kind (top-k among candidates, top-p and min-p by the nucleus
    kernel, the rest sorted), each row's token is the full sort's, step after step."""
    torch.manual_seed(6)
    logits = (torch.randn(len(MIXED_ROWS), 3000) * 3).to(DEV)
    vocab = logits.shape[1]
    assert [sampler._kind(r, vocab) for r in _rows(MIXED_ROWS)] == [1, 1, 1, 2, 0, 0, 1, 1]
    for step in range(8):
        rows = _rows(MIXED_ROWS, seed_base=100 * step)
        monkeypatch.setattr(sampler, "TOP_CANDIDATES", 1 << 20)  # no candidates: the sort
        monkeypatch.setattr(sampler, "_by_kind", lambda logits: False)
        want = sample(logits, rows)[0]
        monkeypatch.undo()
        _kernel_path(monkeypatch)
        assert sample(logits, rows)[0] == want
        monkeypatch.undo()


def test_nucleus_kernel_distribution(monkeypatch):
    _kernel_path(monkeypatch)
    _assert_draws_fit(SamplingParams(temperature=1.3, top_p=0.8), 1500 if DEV == "cpu" else 3000,
                      DEV)


def test_cpu_nucleus_past_the_candidates_is_drawn_without_a_sort(monkeypatch):
    """On the CPU a nucleus wider than the candidates takes the kernel's rounds in torch ops:
    seeded rows draw the full sort's tokens."""
    torch.manual_seed(7)
    logits = torch.randn(4, 5000) * 0.5  # flat: every nucleus reaches past 1,024 tokens
    kws = [dict(temperature=1.0, top_p=0.9), dict(temperature=1.2, top_p=0.5),
           dict(temperature=0.9, min_p=0.02), dict(temperature=1.0, top_p=0.95, min_p=0.1)]
    calls = []
    real = sampler.nucleus_draw
    monkeypatch.setattr(sampler, "nucleus_draw", lambda *a: calls.append(1) or real(*a))
    for step in range(4):
        rows = _rows(kws, seed_base=10 * step)
        got = sample(logits, rows)[0]
        with monkeypatch.context() as m:
            m.setattr(sampler, "_nucleus_row", lambda r, vocab: False)  # the full sort
            want = sample(logits, rows)[0]
        assert got == want
    assert len(calls) == 4
