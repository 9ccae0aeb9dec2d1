"""CUDA graphs of mixed steps (worker/cuda_graph.py): the token-count rungs, which captured
shape a step takes, how a step fills the persistent buffers; the forward of a mixed shape's
metadata (attention from the device tensors alone, padding sequences and tokens) against the
eager forward, on the CPU in Triton's interpreter; graph-replayed against eager on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from skyline import LLM
from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.types import SamplingParams
from skyline.worker.cuda_graph import (
    MAX_MIXED_GRAPHS,
    MAX_MIXED_TOKENS,
    CudaGraphRunner,
    GraphShape,
    capture_layout,
    fill_buffers,
    graph_shapes,
    mixed_sizes,
    pick_shape,
)
from skyline.worker.inputs import RequestState, build_inputs


def test_mixed_sizes_ladder():
    # 256 decodes: rungs 1.5x apart above them, to the cap (the served case: 256 + a prompt)
    assert mixed_sizes(256, 2048) == [384, 512, 768, 1024]
    assert mixed_sizes(256, 2048, cap=4096) == [384, 512, 768, 1024, 1536, 2048]
    assert mixed_sizes(256, 600) == [384, 512, 600]  # the budget is the last rung
    assert mixed_sizes(256, 200) == [200]  # a budget below the decode graphs: one graph
    small = mixed_sizes(8, 8192)
    assert len(small) == MAX_MIXED_GRAPHS and small[-1] == MAX_MIXED_TOKENS  # the largest
    for d, budget in ((1, 64), (16, 100), (1024, 2048), (300, 1000)):
        sizes = mixed_sizes(d, budget)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(budget, MAX_MIXED_TOKENS)
        assert all(b / a <= 1.5 for a, b in zip(sizes, sizes[1:], strict=False))
    assert mixed_sizes(4, 1) == []


def _meta(counts: list[int], qsl_tensor: bool = True) -> AttentionMetadata:
    qsl = [0]
    for c in counts:
        qsl.append(qsl[-1] + c)
    return AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64), query_start_loc=qsl,
        seq_lens=[c + 5 for c in counts], block_tables=torch.zeros(len(counts), 1),
        block_size=16, num_decodes=sum(c == 1 for c in counts),
        query_start_loc_tensor=torch.tensor(qsl) if qsl_tensor else None)


def test_pick_shape():
    shapes = [GraphShape(bs, bs * q, q) for bs, q in graph_shapes(256, 3)]
    shapes += [GraphShape(256, t, 0) for t in mixed_sizes(256, 2048)]

    def pick(counts, qsl_tensor=True):
        return pick_shape(shapes, _meta(counts, qsl_tensor), len(counts), sum(counts))

    assert pick([1] * 200) == GraphShape(208, 208, 1)  # decodes: the decode graphs
    assert pick([3] * 5) == GraphShape(8, 24, 3)  # verifications: the extend graphs
    assert pick([1] * 255 + [128]) == GraphShape(256, 384, 0)  # the served mixed step
    assert pick([1] * 3 + [20]) == GraphShape(256, 384, 0)
    assert pick([1] * 250 + [300, 2]) == GraphShape(256, 768, 0)
    assert pick([1] * 100 + [3] * 100) == GraphShape(256, 512, 0)  # past MAX_EXTEND_TOKENS
    assert pick([1] * 10 + [1100]) is None  # past the largest mixed graph: eager
    assert pick([1] * 257 + [2]) is None  # more sequences than any graph
    assert pick([1] * 3 + [20], qsl_tensor=False) is None
    # a tie between a uniform and a mixed shape: the uniform one
    tie = [GraphShape(4, 8, 2), GraphShape(4, 8, 0)]
    assert pick_shape(tie, _meta([2, 2]), 2, 4) == GraphShape(4, 8, 2)
    assert pick_shape(tie, _meta([1, 3]), 2, 4) == GraphShape(4, 8, 0)


def test_capture_layout():
    assert capture_layout(GraphShape(4, 6, 0)) == ([0, 1, 2, 3, 4], [1] * 4)
    assert capture_layout(GraphShape(4, 2, 0)) == ([0, 1, 2, 2, 2], [1] * 4)


def _states(block_size: int) -> dict[str, RequestState]:
    """Requests with cached prefixes, each on blocks of its own (from 1): decodes, chunks of
    longer prompts, a fresh prompt, a one-token chunk."""
    rng = random.Random(0)
    specs = {"a": (21, 20), "b": (70, 30), "c": (10, 9), "d": (12, 0), "e": (5, 4),
             "f": (40, 17)}  # prompt tokens, computed tokens
    states, nxt = {}, 1
    for rid, (n, done) in specs.items():
        blocks = list(range(nxt, nxt + -(-n // block_size)))
        nxt += len(blocks)
        s = RequestState(rid, [rng.randrange(2, 300) for _ in range(n)], [],
                         SamplingParams(), blocks, done)
        s.token_ids = list(s.prompt_token_ids)
        states[rid] = s
    return states


# the mixed step: two decodes, a one-token chunk, chunks over cached prefixes, a fresh prompt
STEP = {"a": 1, "c": 1, "e": 1, "b": 25, "d": 12, "f": 9}


def _prefill_eagerly(model, states, block_size, device) -> None:
    # the cached prefixes: one eager step over each request's computed tokens
    done = {r: s.num_computed_tokens for r, s in states.items() if s.num_computed_tokens}
    for s in states.values():
        s.num_computed_tokens = 0
    inp = build_inputs(states, done, block_size, device)
    with forward_context(inp.attn):
        model(inp.input_ids, inp.positions)
    for r, n in done.items():
        states[r].num_computed_tokens = n


def test_fill_buffers():
    g = CudaGraphRunner(None, 8, 8, 16, 99, torch.device("cpu"), mixed_tokens=[64])
    inp = build_inputs(_states(16), STEP, 16, torch.device("cpu"))
    t, n = sum(STEP.values()), len(STEP)
    shape = pick_shape(g.shapes, inp.attn, n, t)
    assert shape == GraphShape(8, 64, 0)
    g.slot_mapping.fill_(-1)
    g.query_start_loc.fill_(-1)
    g.block_tables.fill_(-1)
    fill_buffers(g, inp, shape)
    assert torch.equal(g.input_ids[:t], inp.input_ids)
    assert torch.equal(g.positions[:t], inp.positions)
    assert torch.equal(g.slot_mapping[:t], inp.attn.slot_mapping)
    assert (g.slot_mapping[t:] == 99 * 16).all()  # padding tokens: the scratch block
    assert g.query_start_loc.tolist() == inp.attn.query_start_loc + [t] * (8 - n)
    assert g.seq_lens.tolist() == inp.attn.seq_lens + [1] * (8 - n)
    width = inp.attn.block_tables.shape[1]
    assert torch.equal(g.block_tables[:n, :width], inp.attn.block_tables)
    assert (g.block_tables[n:, 0] == 99).all()


@pytest.fixture(scope="module")
def tiny_runner(tiny_llama):
    path = tiny_llama(0.15, "mixed-graph", hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2)
    return lambda device: LLM(path, device=device, dtype="float32", block_size=16,
                              num_blocks=40, max_model_len=128,
                              enforce_eager=True).engine.executor.runner


def _mixed_vs_eager(runner, capture: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixed step's hidden states run eagerly, then through a mixed shape of 8 sequences
    and 64 tokens (graph-replayed with `capture`, else the forward under its metadata)."""
    dev, bs = runner.device, runner.block_size
    states = _states(bs)
    _prefill_eagerly(runner.model, states, bs, dev)
    inp = build_inputs(states, STEP, bs, dev)
    t = inp.positions.shape[0]
    with torch.inference_mode():
        g = CudaGraphRunner(runner.model, 8, 128 // bs, bs, runner.num_blocks, dev,
                            mixed_tokens=[64])
        shape = pick_shape(g.shapes, inp.attn, len(STEP), t)
        assert shape == GraphShape(8, 64, 0)
        if capture:
            g.capture()
            mixed = g.run(inp, shape).clone()
        else:
            fill_buffers(g, inp, shape)
            with forward_context(g._meta(shape)):
                mixed = runner.model(g.input_ids[:64], g.positions[:64])[:t]
        with forward_context(inp.attn):
            eager = runner.model(inp.input_ids, inp.positions)
    return mixed, eager


def test_mixed_metadata_forward_matches_eager_cpu(tiny_runner):
    """A mixed shape's forward reads the step from the device tensors alone (its host lists
    are the capture's): on the CPU, Triton's interpreter runs the mixed attention kernels
    against the eager step's PyTorch references."""
    pytest.importorskip("triton")
    mixed, eager = _mixed_vs_eager(tiny_runner("cpu"), capture=False)
    torch.testing.assert_close(mixed, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_graph_replay_matches_eager_cuda(tiny_runner):
    torch.backends.cuda.matmul.allow_tf32 = False
    runner = tiny_runner("cuda")
    mixed, eager = _mixed_vs_eager(runner, capture=True)
    torch.testing.assert_close(mixed, eager, rtol=1e-4, atol=1e-4)
    logits = runner.model.compute_logits
    assert torch.equal(logits(mixed).argmax(-1), logits(eager).argmax(-1))
