"""A bench probe (worker/queries.py): does a decode step gain from running its batch as two
halves whose attention overlaps the other half's matrix products? (bench/decode_overlap.py)

At ~1,000 sequences a decode step of an 8B model is half paged attention (bound by the KV
cache's bytes) and half matrix products (bound by FLOPs); one after the other, the step costs
their sum. Split in two, the halves can run on two streams with their attention kernels taken
in turn (A's layer i, B's layer i, A's layer i + 1, ...), so that while one half reads its KV
the other runs its o_proj, MLP and next QKV. This times, on the runner's model and KV cache,
the step of `num_decodes` decodes at `context` tokens replayed from CUDA graphs of:

- "one": the whole batch on one stream (what the engine runs);
- "halves": the two halves one after the other on one stream (the cost of splitting);
- "streams": the halves on two streams, free to interleave as the GPU schedules them;
- "alternate": the halves on two streams, attention kernels taken in turn;
- "alternate-smN": the same with cuBLAS told to leave N SMs free (its SM carveout), room for
  the other half's attention while a product runs.

Each variant's hidden states are compared with "one"'s. The engine must be idle: the probe
writes K/V into blocks no request holds (as worker/step_probe.py does), so an engine probed
serves no more requests (a benchmark's engine, shut down after).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from skyline.model.forward_ctx import forward_context
from skyline.types import SamplingParams
from skyline.worker.inputs import RequestState, StepInputs, build_inputs
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


def _inputs(r: ModelRunner, states: dict[str, RequestState], ids: list[str]) -> StepInputs:
    return build_inputs({i: states[i] for i in ids}, dict.fromkeys(ids, 1), r.block_size,
                        r.device)


class TakeTurns:
    """While on, each Attention module's forward (K/V write and attention kernel) waits for
    the previous one's, whichever stream ran it: the halves' attention runs in turn."""

    def __init__(self, attns: list[torch.nn.Module]) -> None:
        self.attns = attns
        self.last: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self.last = None
        for a in self.attns:
            a.forward = self._wrap(type(a).forward.__get__(a))
        try:
            yield
        finally:
            for a in self.attns:
                del a.forward

    def _wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def turn(*args: Any, **kwargs: Any) -> Any:
            stream = torch.cuda.current_stream()
            if self.last is not None:
                stream.wait_event(self.last)
            out = forward(*args, **kwargs)
            self.last = torch.cuda.Event()
            self.last.record(stream)
            return out
        return turn


def _forward(r: ModelRunner, parts: list[StepInputs],
             streams: list[torch.cuda.Stream | None]) -> list[torch.Tensor]:
    """The model's forward of each part, layer by layer, launching part k's layer i after
    part k-1's on streams[k] (None: the current stream)."""
    m = r.model.model

    def on(k: int) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if streams[k] is not None:
            stack.enter_context(torch.cuda.stream(streams[k]))
        stack.enter_context(forward_context(parts[k].attn))
        return stack

    xs: list[Any] = []
    for k, p in enumerate(parts):
        with on(k):
            xs.append((m.embed_tokens(p.input_ids), None))
    for layer in m.layers:
        for k, p in enumerate(parts):
            with on(k):
                xs[k] = layer(p.positions, *xs[k])
    outs = []
    for k in range(len(parts)):
        with on(k):
            outs.append(m.norm(*xs[k])[0])
    return outs


def _prepare(fn: Callable[[], list[torch.Tensor]], streams: list[torch.cuda.Stream | None],
             carveout: int | None, device: torch.device
             ) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """(a call that runs `fn`'s work, the hidden states it leaves): on CUDA, `fn` captured
    once (after an eager warm-up) with its side streams forked from and joined to the capture
    stream, cuBLAS leaving `carveout` SMs free while capturing, and the graph's replay; on the
    CPU, `fn` itself."""
    if device.type != "cuda":
        return fn, fn()
    side = [s for s in streams if s is not None]
    for s in side:
        s.wait_stream(torch.cuda.current_stream())
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    set_carveout = torch._C._set_sm_carveout_experimental
    set_carveout(carveout)
    try:
        with torch.cuda.graph(graph):
            main = torch.cuda.current_stream()
            for s in side:
                s.wait_stream(main)
            outs = fn()
            for s in side:
                main.wait_stream(s)
    finally:
        set_carveout(None)
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay, outs


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
    ids = list(states)
    half = num_decodes // 2
    whole = [_inputs(r, states, ids)]
    halves = [_inputs(r, states, ids[:half]), _inputs(r, states, ids[half:])]
    variants: list[tuple[str, list[StepInputs], list[Any], bool, int | None]] = [
        ("one", whole, [None], False, None), ("halves", halves, [None, None], False, None)]
    if cuda:  # streams, and cuBLAS's carveout where this torch has it
        two = [torch.cuda.Stream(), torch.cuda.Stream()]
        has_carveout = hasattr(torch._C, "_set_sm_carveout_experimental")
        variants += [("streams", halves, two, False, None),
                     ("alternate", halves, two, True, None)]
        variants += [(f"alternate-sm{n}", halves, two, True, n) for n in carveouts
                     if has_carveout]
    turns = TakeTurns(r.model.attention_layers())
    rows: list[dict[str, Any]] = []
    ref: torch.Tensor | None = None
    for name, parts, streams, alternate, carveout in variants:
        with turns.on() if alternate else contextlib.nullcontext():
            run, outs = _prepare(lambda p=parts, s=streams: _forward(r, p, s), streams,
                                 carveout, r.device)
        out = torch.cat(outs).float()
        ref = out if ref is None else ref
        diff = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        seconds = _seconds(run, r.device, reps)
        rows.append({"variant": name, "num_decodes": num_decodes, "context": context,
                     "carveout_sms": carveout, "seconds": seconds,
                     "over_one": seconds / rows[0]["seconds"] if rows else 1.0,
                     "max_rel_diff": diff})
        del run, outs
    return rows
