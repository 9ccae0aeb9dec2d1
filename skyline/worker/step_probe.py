"""A bench probe (worker/queries.py): the forward of a mixed step (decodes beside a prefill
chunk) timed eagerly, replayed from a CUDA graph of exactly its tokens, and replayed from the
engine's own graphs (the padded mixed shape the engine would pick), on the runner's model and
KV cache (bench/mixed_step.py). The engine must be idle: the probe writes K/V into blocks no
request holds only while none runs, and it overwrites blocks the prefix cache may still offer,
so an engine probed serves no more requests (a benchmark's engine, shut down after)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch

from skyline.model.forward_ctx import forward_context
from skyline.types import SamplingParams
from skyline.worker.cuda_graph import CudaGraphRunner, GraphShape
from skyline.worker.inputs import RequestState, StepInputs, build_inputs
from skyline.worker.runner import ModelRunner


def decode_states(r: ModelRunner, num_decodes: int, context: int, rng: random.Random,
                  shared: bool = False) -> dict[str, RequestState]:
    """num_decodes requests of random tokens at `context` cached tokens each, on blocks of
    their own from block 0 on (`shared`: all on the same first blocks)."""
    per = -(-(context + 1) // r.block_size)
    vocab = r.arch.vocab_size
    states: dict[str, RequestState] = {}
    for i in range(num_decodes):
        first = 0 if shared else i * per
        s = RequestState(f"d{i}", [rng.randrange(vocab) for _ in range(context + 1)], [],
                         SamplingParams(), list(range(first, first + per)), context)
        s.token_ids = list(s.prompt_token_ids)
        states[s.req_id] = s
    return states


def _step(r: ModelRunner, num_decodes: int, context: int, chunk: int) -> StepInputs:
    """num_decodes requests at `context` cached tokens each decoding one, and a fresh prompt's
    first `chunk` tokens, on distinct blocks of the pool (one set of blocks for every decode
    when the pool holds too few: their reads then hit the same memory)."""
    bs = r.block_size
    per = -(-(context + 1) // bs)
    shared = num_decodes * per + -(-chunk // bs) > r.num_blocks
    rng = random.Random(0)
    states = decode_states(r, num_decodes, context, rng, shared)
    first = per if shared else num_decodes * per
    s = RequestState("chunk", [rng.randrange(r.arch.vocab_size) for _ in range(chunk)], [],
                     SamplingParams(), list(range(first, first + -(-chunk // bs))), 0)
    s.token_ids = list(s.prompt_token_ids)
    states["chunk"] = s
    scheduled = {rid: 1 for rid in states if rid != "chunk"} | {"chunk": chunk}
    return build_inputs(states, scheduled, bs, r.device)


def seconds_per_call(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Seconds per call of `fn` called back to back (the host runs ahead of the device, as in
    a served step loop), after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / reps


@torch.inference_mode()
def mixed_step_seconds(r: ModelRunner, num_decodes: int, context: int, chunks: list[int],
                       reps: int = 10) -> list[dict[str, Any]]:
    """For each chunk size: seconds of the forward of `num_decodes` decodes at `context`
    tokens beside a `chunk`-token prefill chunk, run eagerly ("eager_s"), replayed from a
    mixed graph of exactly its tokens ("graph_s"), and from the engine's graph for it
    ("engine_graph_s", with "engine_shape": its padded tokens; None where the engine runs the
    step eagerly). Graph figures are None without CUDA graphs (the CPU, --enforce-eager)."""
    rows = []
    seqs = max((s.num_seqs for s in r.graphs.shapes), default=0) if r.graphs else 0
    for chunk in chunks:
        inp = _step(r, num_decodes, context, chunk)
        t = inp.positions.shape[0]

        def eager(inp: StepInputs = inp) -> None:
            with forward_context(inp.attn):
                r.model(inp.input_ids, inp.positions)

        row: dict[str, Any] = {"num_decodes": num_decodes, "context": context, "chunk": chunk,
                               "num_tokens": t,
                               "eager_s": seconds_per_call(eager, r.device, reps),
                               "graph_s": None, "engine_graph_s": None, "engine_shape": None}
        if r.graphs is not None and seqs >= num_decodes + 1:
            shape = r.graphs.shape_for(inp)
            if shape is not None:
                row["engine_shape"] = shape.num_tokens
                row["engine_graph_s"] = seconds_per_call(
                    lambda s=shape, i=inp: r.graphs.run(i, s), r.device, reps)
            # a graph of exactly this step's tokens, in a runner of its own (only that shape)
            exact = GraphShape(seqs, t, 0)
            g = CudaGraphRunner(r.model, seqs, r.graphs.block_tables.shape[1], r.block_size,
                                r.num_blocks, r.device, mixed_tokens=[t])
            g.shapes = [exact]
            g.capture()
            row["graph_s"] = seconds_per_call(lambda g=g, i=inp, s=exact: g.run(i, s),
                                              r.device, reps)
            del g
        rows.append(row)
    return rows
