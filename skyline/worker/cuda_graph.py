"""CUDA graphs for decode-only steps: the model forward captured once per batch-size bucket and
replayed from persistent input buffers, so a decode step costs one launch instead of ~1,000.

A batch of n decodes runs in the smallest captured bucket >= n; the padding rows read and
write a scratch KV block that the block pool never hands out.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.worker.inputs import StepInputs

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s <= max_batch] or [1]


class CudaGraphRunner:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device) -> None:
        self.model = model
        self.sizes = bucket_sizes(max_batch)
        self.block_size = block_size
        self.scratch_block = scratch_block
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64,
                                       device=device)
        self.block_tables = torch.full((n, max_blocks_per_seq), scratch_block, dtype=torch.int32,
                                       device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=list(range(bs + 1)),
            seq_lens=[1] * bs, block_tables=self.block_tables[:bs], block_size=self.block_size,
            num_decodes=bs, seq_lens_tensor=self.seq_lens[:bs],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            meta = self._meta(bs)
            with torch.cuda.stream(stream), forward_context(meta):
                for _ in range(2):  # warm-up: kernel selection and Triton compilation
                    self.model(self.input_ids[:bs], self.positions[:bs])
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), forward_context(meta):
                out = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def bucket(self, num_reqs: int) -> int | None:
        for s in self.sizes:
            if s >= num_reqs:
                return s
        return None

    def run(self, inp: StepInputs, bs: int) -> torch.Tensor:  # [n, hidden]
        n = len(inp.req_ids)
        a = inp.attn
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.slot_mapping[:n].copy_(a.slot_mapping)
        self.seq_lens[:n].copy_(a.seq_lens_tensor)
        self.block_tables[:n, : a.block_tables.shape[1]].copy_(a.block_tables)
        if bs > n:  # padding rows: one token of scratch context
            self.slot_mapping[n:bs].fill_(self.scratch_block * self.block_size)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].fill_(self.scratch_block)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
