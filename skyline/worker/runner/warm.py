"""Eager steps' kernel variants, compiled at start-up.

The Triton kernels take their launch configurations from tables keyed by token and batch
buckets (ops/tuning.py, ops/attention_config.py): the first step whose shape falls in a bucket
no earlier step reached compiles that bucket's variant, seconds with Triton's cache empty, and
the requests of that step wait for it (a served run's TTFT p99 went from 0.7 to 4.7 s with a
cold cache; an offline run of 1,024 short prompts spent 2.8-6.7 of its ~20 s compiling:
bench/host_syncs.py names each compilation). CUDA graphs' warm-ups compile the shapes they
capture; `warm_eager_steps` runs one eager forward for each bucket the other steps reach:
prefills of each token bucket up to the step budget, and each decode batch bucket beside a
short prefill (the mixed steps of a server).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from skyline.model.forward_ctx import AttentionMetadata, forward_context
from skyline.ops.argmax import argmax
from skyline.ops.tuning import TOKEN_BUCKETS

if TYPE_CHECKING:
    from skyline.worker.runner.startup import RunnerStartup

log = logging.getLogger("skyline.worker.runner")

# The prefill beside the decodes of a warm-up's mixed step (tokens).
SHORT_PREFILL = 4


def warm_shapes(max_tokens: int, max_seqs: int,
                max_model_len: int) -> list[tuple[int, list[int]]]:
    """(decodes, prefill lengths) of the warm-up steps. First prefill-only steps of each token
    bucket's largest count within what a step holds, and of that itself (the norms' and
    Linears' buckets), as prompts of at most max_model_len tokens each (so prefill attention
    sees each per-sequence bucket up to there); then 1, 2, 4, ... decodes (the decode kernel's
    batch buckets) beside a prompt of SHORT_PREFILL tokens."""
    shapes: list[tuple[int, list[int]]] = []
    top = min(max_tokens, max_seqs * max_model_len)  # the most tokens a step can hold
    for total in sorted({min(b, top) for b in TOKEN_BUCKETS if b > 1} | {top}):
        full, rest = divmod(total, max_model_len)
        if total > 1:
            shapes.append((0, [max_model_len] * full + ([rest] if rest else [])))
    d = 1
    while d <= max_seqs - 1 and d + SHORT_PREFILL <= max_tokens:
        shapes.append((d, [SHORT_PREFILL]))
        d *= 2
    return shapes


def _meta(decodes: int, prefills: list[int], block_size: int, scratch_block: int,
          device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step of `decodes` one-token sequences (a block of context each) and prompts of
    `prefills` tokens, every position in the scratch block (no pool block is touched); and
    its positions."""
    seq_lens = [block_size] * decodes + prefills
    loc = list(range(decodes + 1))
    for q in prefills:
        loc.append(loc[-1] + q)
    width = max(-(-n // block_size) for n in seq_lens)
    positions = [block_size - 1] * decodes + [p for q in prefills for p in range(q)]
    meta = AttentionMetadata(
        slot_mapping=torch.full((loc[-1],), scratch_block * block_size, dtype=torch.int64,
                                device=device),
        query_start_loc=loc, seq_lens=seq_lens,
        block_tables=torch.full((len(seq_lens), width), scratch_block, dtype=torch.int32,
                                device=device),
        block_size=block_size, num_decodes=decodes,
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_tensor=torch.tensor(loc, dtype=torch.int32, device=device))
    return meta, torch.tensor(positions, device=device)


@torch.inference_mode()
def warm_eager_steps(r: RunnerStartup) -> float:
    """One eager forward (and greedy sample, on the last stage) of each `warm_shapes` step on
    r's device; returns the seconds. Every K/V they write goes to the scratch block past the
    pool's."""
    sc = r.config.scheduler
    t0 = time.perf_counter()
    shapes = warm_shapes(sc.max_num_batched_tokens, r.max_num_seqs, sc.max_model_len)
    for decodes, prefills in shapes:
        meta, positions = _meta(decodes, prefills, r.block_size, r.num_blocks, r.device)
        ids = torch.randint(0, r.arch.vocab_size, (positions.shape[0],), device=r.device)
        with forward_context(meta):
            hidden = r.model(r._stage_input(ids), positions)
        if r.layout.last:  # a logits row per sequence, as a step samples
            logits = r.model.compute_logits(hidden[[n - 1 for n in meta.query_start_loc[1:]]])
            if logits is not None:
                argmax(logits.float())
    torch.cuda.synchronize(r.device)
    dt = time.perf_counter() - t0
    log.info("warmed %d eager step shapes in %.1f s", len(shapes), dt)
    return dt
