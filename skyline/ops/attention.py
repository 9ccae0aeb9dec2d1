"""Paged attention over the KV cache: PyTorch references (CPU and any device).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    _, nb, bs, kvh, d = kv_cache.shape
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    # cache [num_blocks, block_size, kvh, d] -> [n, kvh, d] for one sequence
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    return cache[block_table[:nblk].long()].flatten(0, 1)[:n]


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: list[int],  # [num_seqs + 1]
    seq_lens: list[int],  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    num_decodes: int = 0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    The new tokens of a sequence are its last q_len positions, so query j (0-based within the
    step) at absolute position seq_len - q_len + j sees keys 0..seq_len - q_len + j.
    Sequences [0, num_decodes) have one query token each and are computed as one padded batch.
    """
    out = torch.empty_like(q)
    kc, vc = kv_cache[0], kv_cache[1]
    num_heads, kvh = q.shape[1], kc.shape[2]
    gqa = num_heads != kvh
    if num_decodes:
        lens = seq_lens[:num_decodes]
        max_len = max(lens)
        bs = kc.shape[1]
        nblk = (max_len + bs - 1) // bs
        table = block_tables[:num_decodes, :nblk].long()  # [B, nblk]
        k = kc[table].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, kvh, L, d]
        v = vc[table].flatten(1, 2)[:, :max_len].transpose(1, 2)
        pos = torch.arange(max_len, device=q.device)
        lens_t = torch.tensor(lens, device=q.device)
        valid = pos[None, :] < lens_t[:, None]  # [B, L]
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        # Padded positions read whatever the padding blocks hold; zero them so a NaN left
        # there by another sequence cannot leak through 0 * NaN.
        k = k.masked_fill(~valid[:, None, :, None], 0)
        v = v.masked_fill(~valid[:, None, :, None], 0)
        qd = q[:num_decodes].unsqueeze(2)  # [B, H, 1, d]
        o = F.scaled_dot_product_attention(
            qd, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        out[:num_decodes] = o.squeeze(2)
    for i in range(num_decodes, len(seq_lens)):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        q_len, n = e - s, seq_lens[i]
        k = _gather(kc, block_tables[i], n).transpose(0, 1).to(q.dtype)  # [kvh, n, d]
        v = _gather(vc, block_tables[i], n).transpose(0, 1).to(q.dtype)
        qi = q[s:e].transpose(0, 1)  # [H, q_len, d]
        if q_len == n:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            qpos = torch.arange(n - q_len, n, device=q.device)
            mask = qpos[:, None] >= torch.arange(n, device=q.device)[None, :]  # [q_len, n]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
        out[s:e] = o.transpose(0, 1)
    return out
