"""Checkpoint tensors staged to the GPU through pinned buffers arrive whole and exact (chunked
and out of step with the loaders' copies), and only where the loaders just copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from skyline.model.loader import _stage_on_device
from skyline.model.staging import to_device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staged_tensors_arrive_whole():
    gen = torch.Generator().manual_seed(0)
    host = [("a", torch.randn(1000, 37, generator=gen).bfloat16()),  # several chunks
            ("b", torch.randn(3, generator=gen)), ("empty", torch.empty(0, 4)),
            ("ids", torch.arange(10_000, dtype=torch.int64)),
            ("t", torch.randn(64, 48, generator=gen).t())]  # not contiguous
    got = list(to_device(iter(host), torch.device("cuda"), stage_bytes=4096))
    assert [n for n, _ in got] == [n for n, _ in host]
    for (_, want), (_, t) in zip(host, got, strict=True):
        assert t.is_cuda and t.dtype == want.dtype and t.shape == want.shape
        assert torch.equal(t.cpu(), want)


def test_staging_only_where_the_loaders_just_copy():
    model = nn.Linear(2, 2)
    cuda, one = torch.device("cuda"), SimpleNamespace(world_size=1)
    plain = SimpleNamespace(quant=SimpleNamespace(method="none", layout=None))
    assert _stage_on_device(model, plain, cuda, one)
    assert not _stage_on_device(model, plain, torch.device("cpu"), one)
    assert not _stage_on_device(model, plain, cuda, SimpleNamespace(world_size=2))
    fp8 = SimpleNamespace(quant=SimpleNamespace(method="fp8", layout=None))
    assert not _stage_on_device(model, fp8, cuda, one)
    model.weight_device = "cpu"  # experts kept in host memory (--n-cpu-moe)
    assert not _stage_on_device(model, plain, cuda, one)
