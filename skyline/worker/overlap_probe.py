"""A bench probe (worker/queries.py): does a decode step gain from running its batch as two
halves whose attention overlaps the other half's matrix products? (bench/decode_overlap.py)

This times, on the runner's model and KV cache, the step of `num_decodes` decodes at `context`
tokens replayed from CUDA graphs of:

- "one": the whole batch on one stream (what the engine runs by default);
- "halves": the two halves on one stream, layer by layer (the cost of splitting);
- "streams": the halves on two streams, free to interleave as the GPU schedules them;
- "alternate": the halves on two streams, attention kernels taken in turn (worker/overlap.py:
  what the engine's graphs run with SKYLINE_DECODE_OVERLAP);
- "alternate-smN": the same with cuBLAS told to leave N SMs free (its SM carveout), room for
  the other half's attention while a product runs.

Each variant's hidden states are compared with "one"'s. The engine must be idle: the probe
writes K/V into blocks no request holds (as worker/step_probe.py does), so an engine probed
serves no more requests (a benchmark's engine, shut down after).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from skyline.model.forward_ctx import forward_context
from skyline.types import SamplingParams
from skyline.worker.inputs import RequestState, build_inputs
from skyline.worker.overlap import halves_forward
from skyline.worker.runner import ModelRunner
from skyline.worker.step_probe import _seconds


def _decodes(r: ModelRunner, num_decodes: int, context: int) -> dict[str, RequestState]:
    """num_decodes requests at `context` cached tokens, each on blocks of its own."""
    per = -(-(context + 1) // r.block_size)
    if num_decodes * per > r.num_blocks:
        raise ValueError(f"{num_decodes} sequences of {context} tokens need {num_decodes * per:,}"
                         f" KV blocks; the cache has {r.num_blocks:,}")
    rng = random.Random(0)
    vocab = r.arch.vocab_size
    states = {}
    for i in range(num_decodes):
        s = RequestState(f"d{i}", [rng.randrange(vocab) for _ in range(context + 1)], [],
                         SamplingParams(), list(range(i * per, (i + 1) * per)), context)
        s.token_ids = list(s.prompt_token_ids)
        states[s.req_id] = s
    return states


def _fill(r: ModelRunner, num_blocks: int, chunk: int = 4096) -> None:
    """Random K/V in the first `num_blocks` blocks of every layer's cache (what the probe's
    sequences attend to: no prefill wrote them), a chunk of blocks at a time."""
    gen = torch.Generator(r.device).manual_seed(0)
    for attn in r.model.attention_layers():
        kv = attn.kv_cache
        for start in range(0, num_blocks, chunk):
            part = kv[:, start:min(start + chunk, num_blocks)]
            part.copy_(torch.randn(part.shape, generator=gen, device=r.device) * 0.5)


def _prepare(fn: Callable[[], torch.Tensor], carveout: int | None, device: torch.device
             ) -> tuple[Callable[[], Any], torch.Tensor]:
    """(a call that runs `fn`'s work, the hidden states it leaves): on CUDA, `fn` captured
    once after an eager warm-up (it forks its side streams from the capture stream and joins
    them), cuBLAS leaving `carveout` SMs free while capturing, and the graph's replay; on the
    CPU, `fn` itself."""
    if device.type != "cuda":
        return fn, fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if carveout is not None:
        set_carveout(carveout)
    try:
        with torch.cuda.graph(graph):
            out = fn()
    finally:
        if carveout is not None:
            set_carveout(None)
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, out


@torch.inference_mode()
def decode_overlap_seconds(r: ModelRunner, num_decodes: int, context: int,
                           carveouts: tuple[int, ...] = (), reps: int = 10) -> list[dict[str, Any]]:
    """Seconds of each variant's step (module docstring) and its largest difference from
    "one"'s hidden states, relative to their largest magnitude."""
    if not hasattr(r.model, "model") or not hasattr(r.model.model, "layers"):
        raise ValueError("the overlap probe runs Llama-family models (model.layers)")
    cuda = r.device.type == "cuda"
    states = _decodes(r, num_decodes, context)
    _fill(r, num_decodes * -(-(context + 1) // r.block_size))
    inp = build_inputs(states, dict.fromkeys(states, 1), r.block_size, r.device)

    def one() -> torch.Tensor:
        with forward_context(inp.attn):
            return r.model(inp.input_ids, inp.positions)

    def halves(streams: list[Any], turns: bool) -> Callable[[], torch.Tensor]:
        return lambda: halves_forward(r.model, inp.input_ids, inp.positions, inp.attn, streams,
                                      turns)

    variants: list[tuple[str, Callable[[], torch.Tensor], int | None]] = [
        ("one", one, None), ("halves", halves([None, None], False), None)]
    if cuda:  # streams, and cuBLAS's carveout where this torch has it
        two = [torch.cuda.Stream(), torch.cuda.Stream()]
        variants += [("streams", halves(two, False), None), ("alternate", halves(two, True), None)]
        if hasattr(torch._C, "_set_sm_carveout_experimental"):
            variants += [(f"alternate-sm{n}", halves(two, True), n) for n in carveouts]
    rows: list[dict[str, Any]] = []
    ref: torch.Tensor | None = None
    for name, fn, carveout in variants:
        row = {"variant": name, "num_decodes": num_decodes, "context": context,
               "carveout_sms": carveout, "seconds": None, "over_one": None,
               "max_rel_diff": None, "error": None}
        rows.append(row)
        try:
            run, out = _prepare(fn, carveout, r.device)
        except RuntimeError as e:  # a variant this torch or driver cannot capture
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            if cuda:
                torch.cuda.synchronize()
            continue
        out = out.float()
        ref = out if ref is None else ref
        row["max_rel_diff"] = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        row["seconds"] = _seconds(run, r.device, reps)
        row["over_one"] = row["seconds"] / rows[0]["seconds"] if rows[0]["seconds"] else None
        del run, out
    return rows
