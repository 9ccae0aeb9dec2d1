"""Rejection sampling of draft tokens (spec/verify.py) and the token-id proposers."""

from __future__ import annotations

import math

import torch

from skyline.types import SamplingParams
from skyline.worker.inputs import RequestState
from skyline.worker.spec.ngram import NgramProposer, continuation
from skyline.worker.spec.suffix import SuffixProposer
from skyline.worker.spec.verify import sample_and_verify, verify_rows

VOCAB = 8
PROMPT = [1, 2, 3]


def _state(params: SamplingParams, output: list[int] | None = None) -> RequestState:
    out = list(output or [])
    return RequestState("r", list(PROMPT), out, params, [], 0, PROMPT + out)


def _target(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """Reference target distribution: repetition penalty on the history, temperature, top-k."""
    x = logits.double().clone()
    for t in set(history):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    x = x / params.temperature
    if params.top_k:
        kth = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    return x.softmax(-1)


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    exp = probs * n
    assert counts[exp == 0].sum() == 0, "emitted a token the target excludes"
    nz = exp > 0
    chi2 = (((counts[nz] - exp[nz]) ** 2) / exp[nz]).sum().item()
    dof = int(nz.sum()) - 1
    assert chi2 < dof + 4.5 * math.sqrt(2 * max(dof, 1)) + 10, (chi2, dof)


def test_rejection_sampling_follows_target_distribution():
    """Chi-square: the first emitted token follows p_0 whatever the draft; given the first
    draft was accepted, the second follows p_1 (which sees the first draft as output)."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.9, top_k=6, repetition_penalty=1.3)
    logits = torch.randn(3, VOCAB) * 1.5  # positions 0, 1 and the bonus position
    n = 30000
    for drafts in ([int(logits[0].argmax()), 5], [int(logits[0].argmin()), 2], [4, 4]):
        states = [_state(params, [2])] * n
        stops = [()] * n
        rows = verify_rows(states, [drafts] * n, stops)
        tokens, _ = sample_and_verify(logits.repeat(n, 1), rows, [drafts] * n)
        first = torch.tensor([t[0] for t in tokens])
        p0 = _target(logits[0], params, PROMPT + [2])
        _chi2_ok(torch.bincount(first, minlength=VOCAB).double(), p0, n)
        # every output is the accepted drafts then one target token
        for t in tokens:
            a = len(t) - 1
            assert t[:a] == drafts[:a] and (a == len(drafts) or t[a] != drafts[a])
        second = torch.tensor([t[1] for t in tokens if len(t) > 1])
        if len(second) > 2000:
            p1 = _target(logits[1], params, PROMPT + [2, drafts[0]])
            _chi2_ok(torch.bincount(second, minlength=VOCAB).double(), p1, len(second))


def test_greedy_verification_accepts_while_argmax():
    params = SamplingParams(temperature=0.0)
    logits = torch.full((4, VOCAB), -1.0)
    for j, t in enumerate([3, 5, 6, 7]):
        logits[j, t] = 5.0
    cases = {(3, 5, 6): [3, 5, 6, 7], (3, 5, 0): [3, 5, 6], (0, 5, 6): [3], (3, 0, 6): [3, 5]}
    for drafts, want in cases.items():
        rows = verify_rows([_state(params)], [list(drafts)], [()])
        tokens, _ = sample_and_verify(logits.clone(), rows, [list(drafts)])
        assert tokens == [want]


def test_seeded_verification_is_deterministic():
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(3, VOCAB)
    rows = verify_rows([_state(params)], [[1, 2]], [()])
    a = sample_and_verify(logits.clone(), rows, [[1, 2]])[0]
    b = sample_and_verify(logits.clone(), rows, [[1, 2]])[0]
    assert a == b
    # the first token is the one plain sampling draws at this output index
    plain = sample_and_verify(logits[:1].clone(), verify_rows([_state(params)], [[]], [()]), [[]])
    assert a[0][0] == plain[0][0][0]


def test_ngram_proposer():
    p = NgramProposer(1, 3)
    toks = [5, 6, 7, 8, 9, 5, 6, 7]
    assert p.propose(["a"], [toks], 3) == [[8, 9, 5]]
    toks += [8, 1]  # "8 1" and "1" never seen before
    assert p.propose(["a"], [toks], 3) == [[]]
    # a repeating pattern near the end is continued from the proposal itself
    assert p.propose(["b"], [[1, 2, 1, 2]], 5) == [[1, 2, 1, 2, 1]]
    assert continuation([1, 2, 3], 1, 4) == [2, 3, 2, 3]
    p.finish("a", toks)
    assert "a" not in p.indexes


def test_suffix_proposer_uses_recent_traffic():
    p = SuffixProposer(2, 4)
    answer = [40, 41, 42, 43, 44, 45, 46]
    p.propose(["a"], [[1, 2] + answer], 4)
    p.finish("a", [1, 2] + answer)
    # another request starting the same answer gets the rest from traffic
    assert p.propose(["b"], [[9, 9, 40, 41, 42]], 4) == [[43, 44, 45, 46]]
    # its own history wins a tie of equal match length
    own = [40, 41, 7, 7, 40, 41]
    assert p.propose(["c"], [own], 2) == [[7, 7]]
    # the end of a finished sequence is not extended
    assert p.propose(["d"], [[3, 45, 46]], 4) == [[]]


def test_lookup_proposers_do_no_work_in_plain_steps_and_catch_up():
    """Depth 0 (the next step will not verify) costs nothing: no indexing, no search. The
    indexes catch up, whole, at the next call that wants drafts."""
    for p in (NgramProposer(1, 3), SuffixProposer(1, 3)):
        toks = [5, 6, 7, 8, 9, 5, 6, 7]
        assert p.propose(["a"], [toks], 0) == [[]]
        index = p.indexes if isinstance(p, NgramProposer) else p.own
        assert "a" not in index
        assert p.propose(["a"], [toks], 3) == [[8, 9, 5]]
    # finished traffic is indexed at the first lookup after it, evicted oldest first
    p = SuffixProposer(2, 3, max_traffic_tokens=12)
    for i in range(4):
        p.finish(str(i), [100 + i, 101 + i, 50 + i, 60 + i, 70 + i])
    t = p.traffic
    assert t.pending and not any(t.tables.values())
    assert p.propose(["x"], [[1, 103, 104, 53]], 2) == [[63, 73]]  # the newest survives
    assert not t.pending and sum(len(s) for s in t.seqs.values()) <= 12
    assert p.propose(["y"], [[1, 100, 101, 50]], 2) == [[]]  # the oldest was evicted
