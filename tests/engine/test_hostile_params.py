"""Parameters a hostile client can send: every value that passes SamplingParams.validate fits the
engine's types (the sampler's int64 tensors, msgpack, UTF-8), and child seeds of n > 1 wrap
modulo 2**64 without changing any draw."""

from __future__ import annotations

import msgpack
import pytest
import torch

from skyline.engine.codec import params_from_dict, params_to_dict
from skyline.engine.frontend.output import child_params
from skyline.types import SamplingParams
from skyline.worker.sampler import SamplingRow, sample

BIG = [2**63, 2**64, 2**64 + 1, 10**30]


@pytest.mark.parametrize("field", ["top_k", "min_tokens", "max_tokens", "n", "logprobs"])
@pytest.mark.parametrize("value", BIG)
def test_huge_integers_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(100)


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1])
def test_seed_outside_64_bits_is_refused(value):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=value).validate()


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty",
                                   "presence_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()


def test_stop_token_ids_and_strings():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**64]).validate()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(stop_token_ids=[5, 100]).validate(100)
    with pytest.raises(ValueError, match="Unicode"):
        SamplingParams(stop=["a\ud800b"]).validate()
    with pytest.raises(ValueError, match="Unicode"):
        SamplingParams(regex="\udc00").validate()


def test_every_valid_extreme_crosses_msgpack():
    p = SamplingParams(top_k=2**63 - 1, min_tokens=2**63 - 2, max_tokens=2**63 - 1,
                       seed=2**64 - 1, stop_token_ids=[2**63 - 1], n=3)
    p.validate()
    for i in range(3):
        c = child_params(p, i)
        c.validate()
        d = msgpack.unpackb(msgpack.packb(params_to_dict(c)), strict_map_key=False)
        assert params_from_dict(d) == c


def test_child_seeds_wrap_modulo_2_64():
    p = SamplingParams(n=3, seed=2**64 - 1)
    assert [child_params(p, i).seed for i in range(3)] == [2**64 - 1, 0, 1]
    assert child_params(SamplingParams(n=2, seed=-1), 1).seed == 0


def _draws(params: SamplingParams, logits: torch.Tensor) -> list[int]:
    out = []
    for step in range(6):
        row = SamplingRow(params, [1, 2], list(range(step)), ())
        out.append(sample(logits, [row])[0][0])
    return out


def test_wrapped_seed_draws_the_same_tokens():
    # The sampler mixes seeds modulo 2**64: -1 and 2**64 - 1 are one seed, so a child seed
    # that wrapped draws exactly what the unwrapped one would have.
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    a = _draws(SamplingParams(seed=-1, temperature=1.0), logits)
    b = _draws(SamplingParams(seed=2**64 - 1, temperature=1.0), logits)
    c = _draws(SamplingParams(seed=7, temperature=1.0), logits)
    assert a == b and a != c


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).expand(2, 50)
    rows = [SamplingRow(SamplingParams(top_k=2**63 - 1, seed=3), [1], [], ()),
            SamplingRow(SamplingParams(top_k=0, seed=3), [1], [], ())]
    tokens, _ = sample(logits, rows)
    assert tokens[0] == tokens[1]  # same seed, same (unfiltered) distribution
