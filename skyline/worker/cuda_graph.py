"""CUDA graphs: the model forward captured once per step shape and replayed from persistent
input buffers, so a step costs one launch instead of ~1,000.

Shapes are (sequences, query tokens per sequence). Decode steps (one token each) have a graph
per batch-size bucket. With speculative decoding, verification steps (each request's last
token and its drafts) and other short extends have graphs for 2..max_query_len query tokens
per sequence, as far as `MAX_EXTEND_TOKENS` tokens: without them a verification step of a
small model runs eagerly and costs tens of graph-replayed decode steps.

A step of n sequences and t tokens runs in the smallest captured shape that holds it. Its
tokens stay packed as the runner laid them out (sequence i owns query_start_loc[i:i+2]);
the padding sequences have no query tokens and the padding tokens belong to no sequence:
they compute rows nobody reads and write their K/V to a scratch block the pool never hands
out.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from torch import nn

from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.ops.triton_utils import CompileCount
from skyline.worker.inputs import StepInputs

log = logging.getLogger(__name__)

# Extend graphs cover steps of at most this many tokens (sequences x query tokens). Above it
# a step's matrix products dominate and an eager launch costs little in comparison.
MAX_EXTEND_TOKENS = 512


# Decode graphs cover batches up to this many sequences; larger ones run eagerly.
MAX_GRAPH_BATCH = 1024

# Eager forwards of a shape before its capture. One is enough: it compiles the shape's Triton
# specializations (no compile may happen while capturing), runs each kernel's config lookup,
# and makes cuBLAS create its handle and pick its algorithms. A second found nothing left to
# initialize: no layer's state changes after its first call (the KV cache and its scales are
# fixed before capture), and cuBLAS's workspace for the capture stream is allocated during
# the capture itself, into the graph's pool, however many warm-ups ran on the side stream.
# Each extra warm-up cost an eager forward per graph at start-up.
NUM_WARMUPS = 1


class GraphTime(NamedTuple):
    """A captured shape's start-up seconds: its warm-up forward(s), then its capture; and the
    Triton compilations of its warm-up (the kernel specializations no earlier shape had)."""

    num_seqs: int
    query_len: int
    warmup_s: float
    capture_s: float
    triton_compiles: int = 0
    triton_s: float = 0.0


def bucket_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes with a graph: finer where a padded row costs more of the step.
    Past 512 rows the GEMMs run whole 128-row tiles anyway, so steps of 64 waste little."""
    sizes = ([1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 513, 32))
             + list(range(576, MAX_GRAPH_BATCH + 1, 64)))
    return [s for s in sizes if s <= max_batch] or [1]


# max_num_seqs "auto": as many sequences as the KV cache holds at this many tokens each (or the
# context length, if shorter): more would be preempted at that length, and recomputed.
AUTO_SEQ_TOKENS = 2048
AUTO_MIN_SEQS = 256  # never fewer than the fixed default this replaced


def auto_max_num_seqs(kv_tokens: int, max_model_len: int,
                      max_batch: int = MAX_GRAPH_BATCH) -> tuple[int, str]:
    """max_num_seqs for a cache of `kv_tokens` tokens: the largest decode-graph batch size
    (so that a full batch runs in a graph without padding) whose sequences fit at
    AUTO_SEQ_TOKENS each, within [AUTO_MIN_SEQS, max_batch]; and why, in words."""
    per_seq = max(1, min(AUTO_SEQ_TOKENS, max_model_len))
    fit = kv_tokens // per_seq
    fitting = [b for b in bucket_sizes(max_batch) if b <= fit]
    n = min(max_batch, max(AUTO_MIN_SEQS, fitting[-1] if fitting else 1))
    why = (f"the KV cache holds {kv_tokens:,} tokens = {fit:,} sequences of {per_seq:,} "
           f"tokens; the largest CUDA-graph batch size within that and [{AUTO_MIN_SEQS}, "
           f"{max_batch}] is {n}")
    return n, why


def graph_shapes(max_batch: int, max_query_len: int = 1) -> list[tuple[int, int]]:
    """(sequences, query tokens each) of every graph to capture."""
    shapes = [(bs, 1) for bs in bucket_sizes(max_batch)]
    # extends: powers of two of sequences (a few graphs per query length, to start fast)
    pow2 = [1 << i for i in range(11) if 1 << i <= max(max_batch, 1)]
    for q in range(2, max_query_len + 1):
        shapes += [(bs, q) for bs in pow2 if bs * q <= MAX_EXTEND_TOKENS]
    return shapes


class CudaGraphRunner:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device,
                 max_query_len: int = 1,
                 hidden_input: tuple[int, torch.dtype] | None = None) -> None:
        """`hidden_input` (hidden size, dtype): the forward takes hidden states, not token ids
        (a pipeline stage after the first)."""
        self.model = model
        self.shapes = graph_shapes(max_batch, max_query_len)
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = max(bs * q for bs, q in self.shapes)
        seqs = max(bs for bs, _ in self.shapes)
        if hidden_input is None:
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        else:  # [n, hidden]
            self.input_ids = torch.zeros(n, hidden_input[0], dtype=hidden_input[1],
                                         device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.block_tables = torch.full((seqs, max_blocks_per_seq), scratch_block,
                                       dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_times: list[GraphTime] = []  # in capture order (most tokens first)

    def _meta(self, bs: int, q: int) -> AttentionMetadata:
        """The metadata a graph is captured with: its host-side lists fix the shape (q query
        tokens per sequence); the device tensors are the persistent buffers `run` fills."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * q],
            query_start_loc=list(range(0, bs * q + 1, q)), seq_lens=[q] * bs,
            block_tables=self.block_tables[:bs], block_size=self.block_size,
            num_decodes=bs if q == 1 else 0, seq_lens_tensor=self.seq_lens[:bs],
            query_start_loc_tensor=None if q == 1 else self.query_start_loc[: bs + 1],
        )

    @torch.inference_mode()
    def capture(self, compiles: CompileCount | None = None) -> None:
        """Capture every shape; `compiles`: the start-up's running count of Triton
        compilations, split here by shape."""
        compiles = compiles or CompileCount()
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # most tokens first: smaller graphs reuse the largest one's memory pool
        for bs, q in sorted(self.shapes, key=lambda s: (-s[0] * s[1], -s[1])):
            # every sequence q tokens of scratch context
            self.seq_lens[:bs].fill_(q)
            self.query_start_loc[: bs + 1].copy_(torch.arange(0, bs * q + 1, q))
            meta = self._meta(bs, q)
            ids, pos = self.input_ids[: bs * q], self.positions[: bs * q]
            t0, n0, s0 = time.perf_counter(), compiles.num, compiles.seconds
            with torch.cuda.stream(stream), forward_context(meta):
                for _ in range(NUM_WARMUPS):
                    self.model(ids, pos)
            torch.cuda.current_stream().wait_stream(stream)
            stream.synchronize()  # the warm-up's own time (the capture below syncs anyway)
            t1 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), forward_context(meta):
                out = self.model(ids, pos)
            pool = graph.pool()
            self.graphs[(bs, q)] = (graph, out)
            torch.cuda.synchronize()
            self.capture_times.append(GraphTime(bs, q, t1 - t0, time.perf_counter() - t1,
                                                compiles.num - n0, compiles.seconds - s0))
        self.seq_lens.fill_(1)

    def shape_for(self, inp: StepInputs) -> tuple[int, int] | None:
        """The smallest captured shape that holds this step (fewest tokens), or None."""
        a = inp.attn
        n = len(inp.req_ids)
        loc = a.query_start_loc
        q = 1 if a.num_decodes == n else max(loc[i + 1] - loc[i] for i in range(n))
        if q > 1 and a.query_start_loc_tensor is None:
            return None
        fits = [(bs * qq, qq, bs) for bs, qq in self.graphs if bs >= n and qq >= q
                and (qq == 1) == (q == 1)]
        if not fits:
            return None
        _, qq, bs = min(fits)
        return bs, qq

    def run(self, inp: StepInputs, shape: tuple[int, int]) -> torch.Tensor:  # [t, hidden]
        bs, q = shape
        n = len(inp.req_ids)
        t = inp.input_ids.shape[0]
        a = inp.attn
        self.input_ids[:t].copy_(inp.input_ids)
        self.positions[:t].copy_(inp.positions)
        self.slot_mapping[:t].copy_(a.slot_mapping)
        if bs * q > t:
            self.slot_mapping[t : bs * q].fill_(self.scratch_slot)
        self.seq_lens[:n].copy_(a.seq_lens_tensor)
        self.block_tables[:n, : a.block_tables.shape[1]].copy_(a.block_tables)
        if q > 1:
            self.query_start_loc[: n + 1].copy_(a.query_start_loc_tensor)
            self.query_start_loc[n + 1 : bs + 1].fill_(t)  # padding sequences: no queries
        if bs > n:  # padding rows: one token of scratch context
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs, 0].fill_(self.scratch_block)
        graph, out = self.graphs[(bs, q)]
        graph.replay()
        return out[:t]
