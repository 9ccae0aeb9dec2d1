"""The MoE MLP's temporary memory at prefill sizes (ops/moe.py's grouped path, which the
start-up profile runs at the whole token budget and whose peak the KV cache gives up): bounded
by the pairs' activations, with no fp32 copy of the [T * k, H] expert outputs. Live bytes are
counted over every tensor the forward creates (the GEMM launches stubbed: their outputs are
allocated by the launcher, as on a GPU)."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from skyline.ops import moe
from skyline.ops.triton_utils import triton


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created inside (storages counted once, released
    when freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if key in self._seen or size == 0:
                    continue
                self._seen.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.skipif(triton is None, reason="needs triton (the launcher's grid helpers)")
@pytest.mark.parametrize("t,e,k,h,i", [(512, 16, 4, 256, 64), (2048, 32, 8, 256, 48)])
def test_prefill_temporaries_are_bounded(monkeypatch, t, e, k, h, i):
    from skyline.ops import moe_triton

    monkeypatch.setattr(moe_triton, "grouped_matmul_kernel", _NoLaunch())
    dt = torch.bfloat16
    w13 = moe.ExpertWeights(torch.empty(e, 2 * i, h, dtype=dt))
    w2 = moe.ExpertWeights(torch.empty(e, h, i, dtype=dt))
    x = torch.zeros(t, h, dtype=dt)
    weights, ids = torch.topk(torch.randn(t, e).softmax(-1), k)
    with LiveBytes() as live:
        out = moe.fused_moe_triton(x, w13, w2, weights, ids)
        del out
    p, es = t * k, 2
    # h and its activation (with the CPU reference's silu temporary), or the activation and
    # y; then y, the fp32 sum and the result; plus the pair sort's int64 vectors
    bound = p * es * max(4 * i, i + h) + t * h * (4 + es) + 128 * p + 64 * e
    assert live.peak <= bound, (live.peak, bound)
    assert live.peak < p * h * (es + 4)  # what y and an fp32 copy of it alone would hold
