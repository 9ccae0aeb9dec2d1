"""A bench probe (worker/queries.py): does a decode step gain from running its batch as two
halves whose attention overlaps the other half's matrix products? (bench/decode_overlap.py)

This times, on the runner's model and KV cache, the step of `num_decodes` decodes at `context`
tokens replayed from CUDA graphs of:

- "one": the whole batch on one stream (what the engine runs);
- "halves": the two halves on one stream, layer by layer (the cost of splitting);
- "streams": the halves on two streams, free to interleave as the GPU schedules them;
- "alternate": the halves on two streams, attention kernels taken in turn (A's layer i, B's
  layer i, A's layer i + 1, ...: while one half reads its KV cache, the other runs its
  o_proj, MLP and next QKV);
- "alternate-smN": the same with cuBLAS told to leave N SMs free (its SM carveout), room for
  the other half's attention while a product runs.

Each variant's hidden states are compared with "one"'s. Measured on an H100 (BENCHMARKS.md,
"FP8 W8A8 at large batches"), two streams win back what the split costs and no more: the
engine runs the whole batch. The engine must be idle: the probe writes K/V into blocks no
request holds (as worker/step_probe.py does), so an engine probed serves no more requests (a
benchmark's engine, shut down after).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.worker.inputs import RequestState, StepInputs, build_inputs
from skyline.worker.runner import ModelRunner
from skyline.worker.step_probe import decode_states, seconds_per_call


def _decodes(r: ModelRunner, num_decodes: int, context: int) -> dict[str, RequestState]:
    """num_decodes requests at `context` cached tokens, each on blocks of its own."""
    per = -(-(context + 1) // r.block_size)
    if num_decodes * per > r.num_blocks:
        raise ValueError(f"{num_decodes} sequences of {context} tokens need {num_decodes * per:,}"
                         f" KV blocks; the cache has {r.num_blocks:,}")
    return decode_states(r, num_decodes, context, random.Random(0))


def _fill(r: ModelRunner, num_blocks: int, chunk: int = 4096) -> None:
    """Random K/V in the first `num_blocks` blocks of every layer's cache (what the probe's
    sequences attend to: no prefill wrote them), a chunk of blocks at a time."""
    gen = torch.Generator(r.device).manual_seed(0)
    for attn in r.model.attention_layers():
        kv = attn.kv_cache
        for start in range(0, num_blocks, chunk):
            part = kv[:, start:min(start + chunk, num_blocks)]
            part.copy_(torch.randn(part.shape, generator=gen, device=r.device) * 0.5)


class Turns:
    """While on, each Attention module's forward (the attention kernel) first waits for the
    one launched before it, whichever stream ran it: the halves' attention runs in turn."""

    def __init__(self, attns: list[torch.nn.Module]) -> None:
        self.attns = attns
        self.last: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        self.last = None
        for a in self.attns:
            a.forward = self._turn(type(a).forward.__get__(a))
        try:
            yield
        finally:
            for a in self.attns:
                del a.forward

    def _turn(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def turn(*args: Any, **kwargs: Any) -> Any:
            stream = torch.cuda.current_stream()
            if self.last is not None:
                stream.wait_event(self.last)
            out = forward(*args, **kwargs)
            self.last = torch.cuda.Event()
            self.last.record(stream)
            return out
        return turn


def _halves(r: ModelRunner, inp: StepInputs, streams: list[torch.cuda.Stream | None],
            turns: Turns | None) -> torch.Tensor:
    """The forward of a decode batch as two halves, launched layer by layer in turn, half k
    on streams[k] (None: the current stream) forked from and joined to the current stream,
    their attention kernels alternating with `turns`. -> [n, hidden]."""
    m, a = r.model.model, inp.attn
    n = a.num_seqs
    parts = []
    for s, e in ((0, n // 2), (n // 2, n)):
        parts.append((slice(s, e), AttentionMetadata(
            slot_mapping=a.slot_mapping[s:e], query_start_loc=list(range(e - s + 1)),
            seq_lens=a.seq_lens[s:e], block_tables=a.block_tables[s:e],
            block_size=a.block_size, num_decodes=e - s,
            seq_lens_tensor=None if a.seq_lens_tensor is None else a.seq_lens_tensor[s:e])))
    main = torch.cuda.current_stream() if inp.input_ids.is_cuda else None
    side = [s for s in streams if s is not None]
    for s in side:
        s.wait_stream(main)

    def on(k: int) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.stream(streams[k]))
        stack.enter_context(forward_context(parts[k][1]))
        return stack

    xs: list[Any] = []
    with turns.on() if turns is not None else contextlib.nullcontext():
        for k, (rows, _) in enumerate(parts):
            with on(k):
                xs.append((m.embed_tokens(inp.input_ids[rows]), None))
        for layer in m.layers:
            for k, (rows, _) in enumerate(parts):
                with on(k):
                    xs[k] = layer(inp.positions[rows], *xs[k])
        outs = []
        for k in range(2):
            with on(k):
                outs.append(m.norm(*xs[k])[0])
    for s in side:
        main.wait_stream(s)
    return torch.cat(outs)


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

    turns = Turns(r.model.attention_layers())

    def halves(streams: list[Any], take_turns: bool) -> Callable[[], torch.Tensor]:
        return lambda: _halves(r, inp, streams, turns if take_turns else None)

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
        row["seconds"] = seconds_per_call(run, r.device, reps)
        row["over_one"] = row["seconds"] / rows[0]["seconds"] if rows[0]["seconds"] else None
        del run, out
    return rows
