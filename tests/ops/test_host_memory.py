"""ops/host_memory.py: a module's streamed weights moved into one mapping advised to huge pages,
values, sharing and structure kept; left where they are when huge pages are off."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from skyline import envs
from skyline.ops import cpu_intdot, host_memory

needs_thp = pytest.mark.skipif(not host_memory.available(),
                               reason="no transparent huge pages here")


def _holder() -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)
    w = cpu_intdot.IntDotWeight(torch.randint(0, 255, (64, 96), generator=g, dtype=torch.uint8),
                                torch.rand(64, 3, generator=g).half(),
                                torch.rand(64, 3, generator=g).half(), 8, 32)
    return SimpleNamespace(
        plain=torch.randn(100, 33, generator=g).bfloat16(),
        planes=((torch.randn(8, 8, generator=g), torch.randn(3, generator=g)),),
        codes=w,
        param=torch.nn.Parameter(torch.randn(5, 7, generator=g), requires_grad=False),
        none=None)


@needs_thp
def test_tensors_move_with_their_values_and_structure():
    h = _holder()
    before = {k: v for k, v in vars(h).items()}
    want = [before["plain"].clone(), before["planes"][0][0].clone(), before["codes"].codes.clone(),
            before["param"].data.clone()]
    names = ("plain", "planes", "codes", "param", "none", "missing")
    moved = host_memory.into_huge_pages([(h, n) for n in names])
    assert moved == 100 * 33 * 2 + 8 * 8 * 4 + 3 * 4 + 64 * 96 + 2 * 64 * 3 * 2 + 5 * 7 * 4
    got = [h.plain, h.planes[0][0], h.codes.codes, h.param.data]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert isinstance(h.codes, cpu_intdot.IntDotWeight) and h.codes.bits == 8
    assert h.param is before["param"]  # the Parameter itself stays (tied weights share it)
    # one mapping: every tensor a view of it, the first at a huge page's start, 64-byte aligned
    ptrs = [t.data_ptr() for t in (h.plain, h.planes[0][0], h.planes[0][1], h.codes.codes,
                                   h.codes.scale, h.codes.offset, h.param.data)]
    assert ptrs[0] % host_memory.HUGE_PAGE == 0 and all(p % 64 == 0 for p in ptrs)
    assert len({t.untyped_storage().data_ptr() for t in (h.plain, h.param.data)}) == 1
    plain = want[0]
    del before, want
    gc.collect()  # the mapping lives while a view does
    assert torch.equal(h.plain, plain)


def test_nothing_moves_without_huge_pages(monkeypatch):
    h = _holder()
    plain = h.plain
    monkeypatch.setattr(host_memory, "available", lambda: False)
    assert host_memory.into_huge_pages([(h, "plain")]) == 0 and h.plain is plain
    monkeypatch.undo()
    monkeypatch.setenv("SKYLINE_HUGE_PAGES", "0")
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    assert host_memory.into_huge_pages([(h, "plain")]) == 0 and h.plain is plain


def test_packed_and_empty_tensors_stay():
    h = SimpleNamespace(empty=torch.empty(0), strided=torch.randn(4, 4)[:, ::2])
    keep = dict(vars(h))
    assert host_memory.into_huge_pages([(h, "empty"), (h, "strided")]) == 0
    assert h.empty is keep["empty"] and h.strided is keep["strided"]
