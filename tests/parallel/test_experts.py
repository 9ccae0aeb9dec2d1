"""Expert placements against the single-rank MoE layer: expert parallelism's dispatch and
combine (all-to-all both ways, then the all-gather of the token slices) over 2 and 4 ranks,
with token counts that leave slices uneven or empty, gives every rank the layer's output; the
ranks are threads exchanging through a group of their own (the real collectives run in
test_engines.py's gloo processes). Experts kept in host memory compute the same."""

from __future__ import annotations

import threading

import pytest
import torch

from skyline.model.layers.moe import MoE
from skyline.parallel.experts import AllToAllPlacement, HostPlacement

HIDDEN, INTER, EXPERTS, TOP_K = 16, 8, 5, 2


class ThreadGroup:
    """`size` ranks as threads: each collective is a barrier-separated exchange of lists."""

    def __init__(self, size: int, index: int, board: dict) -> None:
        self.size, self.index, self.board = size, index, board

    def _exchange(self, value: object) -> list:
        barrier = self.board["barrier"]
        self.board[self.index] = value
        barrier.wait()
        every = [self.board[i] for i in range(self.size)]
        barrier.wait()  # everyone has read before the next exchange writes
        return every

    def all_to_all(self, t, out_splits=None, in_splits=None):
        splits = in_splits if in_splits is not None else [t.shape[0] // self.size] * self.size
        every = self._exchange(list(torch.split(t, list(splits))))
        got = torch.cat([parts[self.index] for parts in every])
        assert out_splits is None or got.shape[0] == sum(out_splits)
        return got

    def all_gather(self, t, dim=-1):
        return torch.cat(self._exchange(t), dim=dim)

    def all_reduce(self, t):
        return torch.stack(self._exchange(t)).sum(0)


def _layer(placement=None) -> MoE:
    return MoE(HIDDEN, INTER, EXPERTS, TOP_K, "softmax_renorm", placement=placement)


@pytest.fixture(scope="module")
def full() -> MoE:
    torch.manual_seed(0)
    layer = _layer()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _copy_into(part: MoE, full: MoE) -> MoE:
    """`part` given `full`'s router and the experts it holds."""
    held = part.experts.expert_ids
    with torch.no_grad():
        part.gate.weight.copy_(full.gate.weight)
        for name in ("w13", "w2"):
            getattr(part.experts, name).copy_(getattr(full.experts, name)[held.start:held.stop])
    return part


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_to_all_dispatch_and_combine_give_the_layers_output(full, ranks):
    board: dict = {"barrier": threading.Barrier(ranks, timeout=10)}
    layers = [_copy_into(_layer(AllToAllPlacement.of(EXPERTS, ThreadGroup(ranks, i, board))),
                         full) for i in range(ranks)]
    assert [len(m.experts.expert_ids) for m in layers] == ([3, 2] if ranks == 2 else [2, 1, 1, 1])
    # 0 tokens; fewer tokens than ranks (empty slices); uneven slices; a larger batch
    for num_tokens in (0, 1, 3, 7, 33):
        x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
        want = full(x)
        outs: list = [None] * ranks

        def run(i: int, x=x, outs=outs) -> None:
            outs[i] = layers[i](x)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        for out in outs:
            assert out is not None and out.shape == want.shape
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_experts_in_host_memory_compute_the_same(full):
    layer = _layer()
    layer.experts.place_on_host()
    assert isinstance(layer.experts.placement, HostPlacement)
    assert layer.experts.weight_device == "cpu" and full.experts.weight_device is None
    _copy_into(layer, full)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(layer(x), full(x), rtol=0, atol=0)
