"""CUDA graphs: the model forward captured once per step shape and replayed from persistent
input buffers, so a step costs one launch instead of ~1,000.

Shapes are (sequences, query tokens per sequence). Decode steps (one token each) have a graph
per batch-size bucket. With speculative decoding, verification steps (each request's last
token and its drafts) and other short extends have graphs for 2..max_query_len query tokens
per sequence, as far as `MAX_EXTEND_TOKENS` tokens: without them a verification step of a
small model runs eagerly and costs tens of graph-replayed decode steps.

Mixed steps (a prefill chunk beside the decodes, as staggered arrivals make most steps of a
server) have graphs keyed by their padded token count alone (`mixed_sizes`), each with
max_num_seqs sequences (at most MAX_GRAPH_BATCH): their attention is launched from the token
and sequence counts only (ops/attention.paged_mixed_attention, told by AttentionMetadata.mixed),
so any split of the tokens among the sequences replays the same graph. The forward reads
nothing else of a step on the host (the Linears, MoE layers and norms run at the padded token
count), so nothing else of the capture's layout stays in the graph.

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
    num_tokens: int = 0  # the shape's padded tokens (a mixed graph's differ from seqs x query)

# Mixed graphs cover steps of at most this many tokens. An eager forward of Llama-3.1-8B costs
# the host ~20 ms (served mixed steps of ~400 tokens took 23-28 ms where offline's graph-replayed
# decode steps of 256 took ~10: BENCHMARKS.md, "Served on the H200 against offline"); its matrix
# products take as long at ~1,000 tokens (16 GFLOP a token at ~700 TFLOP/s), so past that an
# eager step is bound by the GPU and a padded graph would only add work.
# bench/mixed_step.py measures both sides of this bound.
MAX_MIXED_TOKENS = 1024
# At most this many mixed graphs (the largest rungs): each costs ~0.5 s of start-up.
MAX_MIXED_GRAPHS = 6


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


class GraphShape(NamedTuple):
    """A captured step shape: `num_seqs` sequences (padding included) in `num_tokens` tokens,
    each sequence `query_len` of them, or (query_len 0) a mixed shape: any split of the
    tokens among the sequences."""

    num_seqs: int
    num_tokens: int
    query_len: int

    @property
    def mixed(self) -> bool:
        return self.query_len == 0


def graph_shapes(max_batch: int, max_query_len: int = 1) -> list[tuple[int, int]]:
    """(sequences, query tokens each) of every uniform graph to capture."""
    shapes = [(bs, 1) for bs in bucket_sizes(max_batch)]
    # extends: powers of two of sequences (a few graphs per query length, to start fast)
    pow2 = [1 << i for i in range(11) if 1 << i <= max(max_batch, 1)]
    for q in range(2, max_query_len + 1):
        shapes += [(bs, q) for bs in pow2 if bs * q <= MAX_EXTEND_TOKENS]
    return shapes


def mixed_sizes(max_decode_tokens: int, max_tokens: int,
                cap: int = MAX_MIXED_TOKENS) -> list[int]:
    """Token counts of the mixed graphs: powers of two and 1.5x powers of two (a padded step
    costs at most 1.5x its tokens) above the largest decode graph's token count, then the
    step budget `max_tokens` capped at `cap`; the MAX_MIXED_GRAPHS largest. A budget at or
    below the decode graphs' tokens gets one graph of the budget."""
    top = min(cap, max_tokens)
    rungs = sorted({r for i in range(1, top.bit_length() + 1) for r in (1 << i, 3 << (i - 1))
                    if max_decode_tokens < r < top})
    return (rungs + [top])[-MAX_MIXED_GRAPHS:] if top > 1 else []


class CudaGraphRunner:
    def __init__(self, model: nn.Module, max_batch: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int, device: torch.device,
                 max_query_len: int = 1,
                 hidden_input: tuple[int, torch.dtype] | None = None,
                 mixed_tokens: list[int] | tuple[int, ...] = ()) -> None:
        """`hidden_input` (hidden size, dtype): the forward takes hidden states, not token ids
        (a pipeline stage after the first). `mixed_tokens`: the token counts of the mixed
        graphs (mixed_sizes; empty: none), each of max_batch sequences (a batch size between
        two decode graphs' still runs every mixed step in a graph)."""
        self.model = model
        self.shapes = [GraphShape(bs, bs * q, q) for bs, q in graph_shapes(max_batch,
                                                                          max_query_len)]
        seqs = max(max_batch, *(s.num_seqs for s in self.shapes))
        self.shapes += [GraphShape(seqs, t, 0) for t in sorted(set(mixed_tokens))]
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        n = max(s.num_tokens for s in self.shapes)
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
        self.graphs: dict[GraphShape, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_times: list[GraphTime] = []  # in capture order (most tokens first)

    @property
    def num_mixed(self) -> int:
        return sum(s.mixed for s in self.graphs)

    def _meta(self, shape: GraphShape) -> AttentionMetadata:
        """The metadata a graph is captured with: a uniform shape's host-side lists fix it (q
        query tokens per sequence); a mixed shape's are the capture's layout (capture_layout)
        and `mixed` tells attention to read none of them. The device tensors are the
        persistent buffers `run` fills."""
        bs, t, q = shape
        if shape.mixed:
            loc, lens = capture_layout(shape)
        else:
            loc, lens = list(range(0, t + 1, q)), [q] * bs
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=loc, seq_lens=lens,
            block_tables=self.block_tables[:bs], block_size=self.block_size,
            num_decodes=bs if q == 1 else 0, seq_lens_tensor=self.seq_lens[:bs],
            query_start_loc_tensor=None if q == 1 else self.query_start_loc[: bs + 1],
            mixed=shape.mixed,
        )

    @torch.inference_mode()
    def capture(self, compiles: CompileCount | None = None) -> None:
        """Capture every shape; `compiles`: the start-up's running count of Triton
        compilations, split here by shape."""
        compiles = compiles or CompileCount()
        # A capture after steps have run (the unfuse query captures again) finds the last
        # step's slots and block tables in the buffers: each warm-up is an eager forward that
        # would write its K/V into those slots (blocks the prefix cache may serve again) and
        # read those blocks. Every slot and block goes back to the scratch block first.
        self.slot_mapping.fill_(self.scratch_slot)
        self.block_tables.fill_(self.scratch_block)
        self.capture_times = []
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # most tokens first: smaller graphs reuse the largest one's memory pool
        for shape in sorted(self.shapes, key=lambda s: (-s.num_tokens, -s.query_len)):
            bs, t, q = shape
            meta = self._meta(shape)
            # uniform: every sequence q tokens of scratch context; mixed: capture_layout
            self.seq_lens[:bs].copy_(torch.tensor(meta.seq_lens))
            self.query_start_loc[: bs + 1].copy_(torch.tensor(meta.query_start_loc))
            ids, pos = self.input_ids[:t], self.positions[:t]
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
            self.graphs[shape] = (graph, out)
            torch.cuda.synchronize()
            self.capture_times.append(GraphTime(bs, q, t1 - t0, time.perf_counter() - t1,
                                                compiles.num - n0, compiles.seconds - s0, t))
        self.seq_lens.fill_(1)

    def shape_for(self, inp: StepInputs) -> GraphShape | None:
        """The captured shape that holds this step with the fewest tokens (a uniform one on a
        tie), or None."""
        return pick_shape(self.graphs, inp.attn, len(inp.req_ids), inp.positions.shape[0])

    def run(self, inp: StepInputs, shape: GraphShape) -> torch.Tensor:  # [t, hidden]
        """Fill the persistent buffers with the step (fill_buffers) and replay its graph."""
        fill_buffers(self, inp, shape)
        graph, out = self.graphs[shape]
        graph.replay()
        return out[: inp.positions.shape[0]]


def capture_layout(shape: GraphShape) -> tuple[list[int], list[int]]:
    """(query_start_loc, seq_lens) a mixed graph is captured with: a one-token sequence of
    one token of scratch context per token, as far as both go; the other sequences padding
    (no tokens), the other tokens padding (no sequence)."""
    m = min(shape.num_seqs, shape.num_tokens)
    return list(range(m + 1)) + [m] * (shape.num_seqs - m), [1] * shape.num_seqs


def pick_shape(shapes: dict[GraphShape, object] | list[GraphShape], a: AttentionMetadata,
               n: int, t: int) -> GraphShape | None:
    """The shape of `shapes` that holds a step of n sequences and t tokens described by `a`
    with the fewest tokens (a uniform one on a tie), or None. A uniform shape holds the step
    when every sequence's query tokens fit its query length (decodes only in decode shapes),
    a mixed one when the sequences and tokens fit and the step has its query_start_loc on
    the device."""
    loc = a.query_start_loc
    q = 1 if a.num_decodes == n else max(loc[i + 1] - loc[i] for i in range(n))
    fits = []
    for s in shapes:
        if s.num_seqs < n or s.num_tokens < t:
            continue
        if s.mixed:
            ok = a.query_start_loc_tensor is not None
        else:
            ok = s.query_len >= q and (s.query_len == 1) == (q == 1) and (
                q == 1 or a.query_start_loc_tensor is not None)
        if ok:
            fits.append(s)
    return min(fits, key=lambda s: (s.num_tokens, s.mixed)) if fits else None


def fill_buffers(r: CudaGraphRunner, inp: StepInputs, shape: GraphShape) -> None:
    """Copy a step into `r`'s persistent buffers for `shape`: its tokens, then padding
    tokens writing to the scratch slot, padding sequences with no query tokens (one token of
    scratch context)."""
    bs, pad_t, q = shape
    n = len(inp.req_ids)
    t = inp.positions.shape[0]
    a = inp.attn
    r.input_ids[:t].copy_(inp.input_ids)
    r.positions[:t].copy_(inp.positions)
    r.slot_mapping[:t].copy_(a.slot_mapping)
    if pad_t > t:
        r.slot_mapping[t:pad_t].fill_(r.scratch_slot)
    r.seq_lens[:n].copy_(a.seq_lens_tensor)
    r.block_tables[:n, : a.block_tables.shape[1]].copy_(a.block_tables)
    if q != 1:
        r.query_start_loc[: n + 1].copy_(a.query_start_loc_tensor)
        r.query_start_loc[n + 1 : bs + 1].fill_(t)  # padding sequences: no queries
    if bs > n:  # padding rows: one token of scratch context
        r.seq_lens[n:bs].fill_(1)
        r.block_tables[n:bs, 0].fill_(r.scratch_block)
