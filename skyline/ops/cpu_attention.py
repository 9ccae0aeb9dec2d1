"""Decode attention on the CPU in a handful of torch operations (reference: attention_ref.py's
_decode_ref, which this must match).

A CPU decode step of a small model is bound by how many operations Python dispatches, not by
their arithmetic: a 576-wide layer's attention over a few hundred cached tokens is
microseconds of work behind ~20 dispatches in the reference (two gathers, per-tensor dtype
casts, GQA expansion). Here K and V come out of the cache in one gather, are cast to float32 in
one operation (torch's CPU attention over one query row is several times slower in bfloat16),
and the query heads that share a KV head become that head's query rows, so grouped-query
attention needs no expansion: 5 operations and some views per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class DecodeGather(NamedTuple):
    """What every layer's decode attention of one step reads the same way (made once per
    step): the cache blocks to gather, the longest context, and the padding mask."""

    blocks: torch.Tensor  # [B * nblk] block ids, sequence-major
    max_len: int
    valid: torch.Tensor | None  # [B, max_len] bool, None when every sequence is max_len long


def decode_gather(seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
                  seq_lens_tensor: torch.Tensor | None = None) -> DecodeGather:
    """The DecodeGather of B decoding sequences (block_tables [B, max_blocks] int32)."""
    max_len = max(seq_lens)
    nblk = -(-max_len // block_size)
    valid = None
    if min(seq_lens) < max_len:
        lens = seq_lens_tensor if seq_lens_tensor is not None else torch.tensor(seq_lens)
        valid = torch.arange(max_len) < lens[: len(seq_lens), None]
    return DecodeGather(block_tables[:, :nblk].flatten(), max_len, valid)


def decode_attention_cpu(
    q: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    gather: DecodeGather,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    b, h, d = q.shape
    _, nb, bs, kvh, _ = kv_cache.shape
    # index_select over whole blocks: ~10x faster than advanced indexing of the cache
    blocks = kv_cache.view(2, nb, bs * kvh * d).index_select(1, gather.blocks)
    kv = blocks.view(2, b, -1, kvh, d)[:, :, : gather.max_len].permute(0, 1, 3, 2, 4)
    # [2, B, kvh, L, d], contiguous float32: one copy that also casts
    kv = kv.to(torch.float32, memory_format=torch.contiguous_format)
    mask = None
    if gather.valid is not None:
        # padding slots hold other sequences' values (or NaN): zero them, as the reference
        kv = kv.masked_fill(~gather.valid[None, :, None, :, None], 0)
        mask = gather.valid[:, None, None, :]
    k, v = kv.unbind(0)
    qg = q.float().view(b, kvh, h // kvh, d)  # the heads of KV head i are rows i*g .. i*g+g-1
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale * k_scale)
    o = o.view(b, h, d)
    return (o if v_scale == 1.0 else o * v_scale).to(q.dtype)
