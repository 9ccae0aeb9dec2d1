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


FORMATS = ["none", "fp8", "mxfp4", "mxfp4-checkpoint"]


def _loaded_layer(fmt: str, ckpt: dict, tp=None) -> MoE:
    """A layer of 4 experts (64 -> 64 -> 64) in `fmt`, given the router and per-expert
    checkpoint tensors of `ckpt`; with `tp` (a group) this rank's part of every expert."""
    from types import SimpleNamespace

    from skyline.parallel.groups import Group
    from skyline.quant.experts import make_expert_method

    layer = MoE(64, 64, 4, 2, "softmax_renorm", bias=True)
    layer.experts.set_expert_method(make_expert_method(fmt.split("-")[0],
                                                       prequantized=fmt.endswith("checkpoint")))
    if tp is not None:
        layer.experts.shard(SimpleNamespace(ep=Group.single(), tp=tp))
    with torch.no_grad():
        layer.gate.weight.copy_(ckpt["gate"])
        for name, param in layer.experts.named_parameters():
            kind = name.rpartition("_")[2] if "_" in name else "weight"
            for e, part in param.shard_ids:
                param.weight_loader(param, ckpt[e, part, kind], (e, part))
    after = getattr(layer.experts.expert_method, "process_weights_after_loading", None)
    if after is not None:
        after(layer.experts)
    return layer


@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_parallel_holds_a_slice_of_every_expert(fmt):
    """Without --expert-parallel, each of 2 ranks holds half of every expert's intermediate
    size (gate and up rows, down columns; MXFP4 codes and scales by blocks of 32; the down
    bias once) and the summed outputs are the layer's."""
    from skyline.quant.fp4 import quantize_mxfp4

    gen = torch.Generator().manual_seed(1)
    ckpt: dict = {"gate": torch.randn(4, 64, generator=gen)}
    for e in range(4):
        for part in ("gate", "up", "down"):
            w = torch.randn(64, 64, generator=gen) * 0.2
            ckpt[e, part, "weight"] = w
            ckpt[e, part, "bias"] = torch.randn(64, generator=gen) * 0.1
            codes, scales = quantize_mxfp4(w)
            ckpt[e, part, "blocks"] = codes.view(64, 2, 16)  # as gpt-oss ships them
            ckpt[e, part, "scales"] = scales
    full = _loaded_layer(fmt, ckpt)
    board: dict = {"barrier": threading.Barrier(2, timeout=10)}
    ranks = [_loaded_layer(fmt, ckpt, ThreadGroup(2, i, board)) for i in range(2)]
    assert all(r.experts.intermediate_size == 32 and r.experts.num_experts == 4 for r in ranks)
    x = torch.randn(9, 64, generator=gen)
    want = full(x)
    outs: list = [None, None]

    def run(i: int) -> None:
        outs[i] = ranks[i](x)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if fmt == "fp8":  # each rank scales its rows over its own columns: errors of their own,
        # no larger than one process's against the unquantized layer's output
        dense = _loaded_layer("none", ckpt)(x)
        one = (want - dense).abs().max()
        assert all(0 < (out - dense).abs().max() < 1.5 * one for out in outs)
        return
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_mxfp4_split_inside_a_block_is_refused():
    from types import SimpleNamespace

    from skyline.config import ConfigError
    from skyline.parallel.groups import Group
    from skyline.quant.experts import make_expert_method

    layer = MoE(64, 64, 4, 2, "softmax_renorm")
    layer.experts.set_expert_method(make_expert_method("mxfp4"))
    tp = ThreadGroup(4, 0, {})
    with pytest.raises(ConfigError, match="not whole blocks of 32; use --expert-parallel"):
        layer.experts.shard(SimpleNamespace(ep=Group.single(), tp=tp))
