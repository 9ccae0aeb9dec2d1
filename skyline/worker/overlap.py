"""A large decode batch as two halves on two streams, their attention kernels taken in turn.

At ~1,000 sequences a decode step of an 8B model is about half paged attention, bound by the
KV cache's bytes, and half matrix products, bound by FLOPs; run one after the other, the step
costs their sum. Split in two, the halves run their layers on two streams, and each attention
kernel waits for the other half's previous one (Turns): while half A reads its KV cache for
layer i, half B runs its o_proj, MLP and next QKV, and the other way round. Both halves run
the model's own layers (`layer_steps`, paused after each layer so that the host launches them
interleaved), so every row computes what it computes in the whole batch; only the products'
row counts change. bench/decode_overlap.py measures what it buys; CudaGraphRunner captures the
decode graphs of at least SKYLINE_DECODE_OVERLAP sequences this way.
"""

from __future__ import annotations

from typing import Any

import torch

from skyline.model.forward_ctx import AttentionMetadata, forward_context


class Turns:
    """The halves' attention kernels one at a time, alternating: each waits for the kernel
    launched before it (the other half's) before it starts."""

    def __init__(self) -> None:
        self.last: torch.cuda.Event | None = None

    def wait(self) -> None:
        if self.last is not None:
            torch.cuda.current_stream().wait_event(self.last)

    def done(self) -> None:
        self.last = torch.cuda.Event()
        self.last.record(torch.cuda.current_stream())


def split_decodes(meta: AttentionMetadata, turns: Turns | None) -> list[tuple[slice,
                                                                           AttentionMetadata]]:
    """A pure decode batch's metadata as two halves (the rows of each, and its metadata: views
    of the batch's tensors, so a CUDA graph's persistent buffers feed both)."""
    n = meta.num_seqs
    assert meta.num_decodes == n and not meta.mixed, "only a pure decode batch splits"
    parts = []
    for s, e in ((0, n // 2), (n // 2, n)):
        parts.append((slice(s, e), AttentionMetadata(
            slot_mapping=meta.slot_mapping[s:e], query_start_loc=list(range(e - s + 1)),
            seq_lens=meta.seq_lens[s:e], block_tables=meta.block_tables[s:e],
            block_size=meta.block_size, num_decodes=e - s,
            seq_lens_tensor=None if meta.seq_lens_tensor is None else meta.seq_lens_tensor[s:e],
            turns=turns)))
    return parts


def halves_forward(model: Any, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, streams: list[torch.cuda.Stream | None],
                   take_turns: bool = True) -> torch.Tensor:
    """The forward of a decode batch as two halves, launched layer by layer in turn, half k
    on streams[k] (None: the current stream) forked from and joined to the current stream;
    with `take_turns`, their attention kernels alternate (Turns). -> [n, hidden]."""
    main = torch.cuda.current_stream() if input_ids.is_cuda else None
    side = [s for s in streams if s is not None]
    for s in side:
        s.wait_stream(main)
    turns = Turns() if take_turns else None
    runs = []
    for (rows, m), stream in zip(split_decodes(meta, turns), streams, strict=True):
        runs.append([model.layer_steps(input_ids[rows], positions[rows]), m, stream, None])
    live = True
    while live:
        live = False
        for run in runs:
            steps, m, stream, out = run
            if out is not None:
                continue
            with torch.cuda.stream(stream), forward_context(m):
                try:
                    next(steps)
                    live = True
                except StopIteration as stop:
                    run[3] = stop.value
    for s in side:
        main.wait_stream(s)
    return torch.cat([run[3] for run in runs])
