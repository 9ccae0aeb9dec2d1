"""The PyTorch references of paged attention (CPU and any device): `paged_attention_ref` and
its parts (a padded batch of decodes, one extend per sequence), the softmax attention they share
(`attend_ref`, with sinks, windows and bounded score memory), the CPU's few-query path, and the
reference of the decode kernel's split combine. ops/attention.py dispatches to these or to the
Triton kernels (ops/attention_triton.py) they check; the KV cache layout and its fp8 scales are
as ops/attention.py's docstring says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    # cache [num_blocks, block_size, kvh, d] -> [n, kvh, d] for one sequence
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    return cache[block_table[:nblk].long()].flatten(0, 1)[:n]


# Score elements (float32) attend_ref materializes at once where torch's attention would not
# serve it: longer query runs go in chunks (a profiling forward of 8,192 tokens over 64 heads
# would take 17 GiB whole).
ATTEND_CHUNK = 1 << 26


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, sinks: torch.Tensor | None = None,
               causal: bool = False) -> torch.Tensor:
    """Softmax attention of q [..., H, Lq, D] over k/v [..., KVH, L, D] (GQA: query head h
    reads kv head h // (H / KVH)); `mask` [..., Lq, L] True where a query sees a key, or None
    (all, or causal with `causal`: query i of Lq sees keys up to L - Lq + i). `sinks` [H]
    (gpt-oss): one more logit per head in every softmax's denominator, attending to nothing.
    Torch's attention serves it without sinks, where its masks stay small (a masked call may
    fall back to a kernel that holds every score); the rest runs in chunks of queries."""
    lq, n = q.shape[-2], k.shape[-2]
    heads = q[..., 0, 0].numel()  # batch x heads
    if sinks is None and (mask is None or heads * lq * n <= ATTEND_CHUNK):
        # with a batch dimension: torch's fused kernels (the CPU's flash kernel included) take
        # 4-D inputs only, 3-D ones fall back to the math kernel, which holds every score (on
        # the CPU 2.6x slower at 512 tokens, 4.5x at 1,024: bench/cpu_attention_speed.py)
        batched = q.dim() == 3
        o = F.scaled_dot_product_attention(*(t[None] if batched else t for t in (q, k, v)),
                                           attn_mask=mask, scale=scale,
                                           is_causal=causal and mask is None,
                                           enable_gqa=q.shape[-3] != k.shape[-3])
        return o[0] if batched else o
    if q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    if mask is None and causal:
        mask = causal_mask(n - lq, n, 0, q.device)
    rows = max(1, ATTEND_CHUNK // max(1, heads * n))
    out = []
    for i in range(0, lq, rows):
        s = torch.matmul(q[..., i:i + rows, :].float(), k.float().transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(~mask[..., i:i + rows, :], float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(-1, 1, 1).expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out.append(torch.matmul(p, v.float()).to(q.dtype))
    return torch.cat(out, dim=-2)


def _decode_ref(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    kv_cache: torch.Tensor,
    seq_lens: list[int],  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    seq_lens_tensor: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    # All one-token sequences as one padded batch.
    kc, vc = kv_cache[0], kv_cache[1]
    max_len = max(seq_lens)
    # With a window only the last `window` positions of each sequence are read.
    first = max(0, min(seq_lens) - window) if window else 0
    bs = kc.shape[1]
    nblk = (max_len + bs - 1) // bs
    table = block_tables[:, first // bs:nblk].long()  # [B, nblk - first // bs]
    base = first // bs * bs  # the position of the table's first slot
    k = kc[table].flatten(1, 2)[:, :max_len - base].transpose(1, 2)  # [B, kvh, L, d]
    v = vc[table].flatten(1, 2)[:, :max_len - base].transpose(1, 2)
    # On a CPU in float32: torch's CPU attention for one query row is several times slower
    # in bfloat16 than in float32 (5-8x; bench/cpu_attention_speed.py), and K/V are small.
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    k, v = k.to(dtype), v.to(dtype)
    mask = None  # sequences of one length (batch 1, say) have no padding to mask
    if min(seq_lens) < max_len or window:
        pos = torch.arange(base, max_len, device=q.device)
        # A host list copied to the GPU here would synchronise every layer; use the device copy.
        lens_t = seq_lens_tensor if seq_lens_tensor is not None else torch.tensor(
            seq_lens, device=q.device)
        valid = pos[None, :] < lens_t[:, None]  # [B, L]
        if window:
            valid &= pos[None, :] >= lens_t[:, None] - window
        # Padded positions read whatever the padding blocks hold; zero them so a NaN left
        # there by another sequence cannot leak through 0 * NaN.
        k = k.masked_fill(~valid[:, None, :, None], 0)
        v = v.masked_fill(~valid[:, None, :, None], 0)
        mask = valid[:, None, None, :]
    # the fp8 scales, folded in: scores * k_scale, output * v_scale
    o = attend_ref(q.unsqueeze(2).to(dtype), k, v, mask, scale * k_scale, sinks)
    return _times(o.squeeze(2), v_scale).to(q.dtype)


def _times(x: torch.Tensor, s: float) -> torch.Tensor:
    return x if s == 1.0 else x * s


def _extend_ref(
    q: torch.Tensor,  # [q_len, num_heads, head_dim], the last q_len positions of the sequence
    kv_cache: torch.Tensor,
    seq_len: int,
    block_table: torch.Tensor,  # [max_blocks]
    scale: float,
    k_scale: float,
    v_scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len = q.shape[0]
    k = _gather(kv_cache[0], block_table, seq_len).transpose(0, 1).to(q.dtype)  # [kvh, n, d]
    v = _gather(kv_cache[1], block_table, seq_len).transpose(0, 1).to(q.dtype)
    qi = q.transpose(0, 1)  # [H, q_len, d]
    scale = scale * k_scale
    if q_len == seq_len and not window:
        o = attend_ref(qi, k, v, None, scale, sinks, causal=True)
    else:
        # query j sits at absolute position seq_len - q_len + j and sees keys up to it (and,
        # with a window, none `window` or more positions before it)
        mask = causal_mask(seq_len - q_len, seq_len, window, q.device)  # [q_len, n]
        if sinks is not None and q.device.type == "cpu" and q_len <= SMALL_EXTEND:
            o = _attend_small(qi, k, v, mask, scale, sinks)
        else:
            o = attend_ref(qi, k, v, mask, scale, sinks)
    return _times(o.transpose(0, 1), v_scale)


def causal_mask(first: int, seq_len: int, window: int, device: torch.device | str
                ) -> torch.Tensor:
    """[seq_len - first, seq_len] bool: query positions first.. against key positions 0..,
    True where the query sees the key (causal; within `window` positions when it is > 0)."""
    qpos = torch.arange(first, seq_len, device=device)[:, None]
    kpos = torch.arange(seq_len, device=device)[None, :]
    mask = qpos >= kpos
    return mask & (qpos - kpos < window) if window else mask


# Queries of an extend with sinks (which torch's attention does not take) up to which the CPU
# takes _attend_small, a few matmuls, rather than attend_ref's chunks. Without sinks torch's
# flash kernel wins at every size from one query (bench/cpu_attention_speed.py).
SMALL_EXTEND = 64


def _attend_small(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [H, q_len, d] over k/v [KVH, n, d] with mask [q_len, n] (True: attend), the query
    heads of one kv head batched as rows of one matmul, in float32 -> [H, q_len, d]. `sinks`
    as attend_ref's."""
    h, q_len, d = q.shape
    kvh, n, _ = k.shape
    qg = q.float().reshape(kvh, (h // kvh) * q_len, d)  # heads of kv head i are i*g..i*g+g-1
    s = torch.bmm(qg, k.float().transpose(1, 2)) * scale  # [KVH, g * q_len, n]
    s = s.view(kvh, h // kvh, q_len, n).masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(kvh, h // kvh, 1, 1).expand(kvh, h // kvh, q_len, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.bmm(p.reshape(kvh, (h // kvh) * q_len, n), v.float()).view(h, q_len, d).to(
        q.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: list[int],  # [num_seqs + 1]
    seq_lens: list[int],  # [num_seqs]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    num_decodes: int = 0,
    seq_lens_tensor: torch.Tensor | None = None,  # [num_seqs] int32, seq_lens on q's device
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    The new tokens of a sequence are its last q_len positions. Sequences [0, num_decodes)
    have one query token each and are computed as one padded batch. The cache holds
    K / k_scale and V / v_scale (kv_write.write_kv_ref). With `window` > 0 a query sees only
    the keys less than `window` positions before it (sliding-window attention); `sinks`, one
    logit per head, joins every softmax's denominator (attend_ref).
    """
    out = torch.empty_like(q)
    if num_decodes:
        lens_t = None if seq_lens_tensor is None else seq_lens_tensor[:num_decodes]
        out[:num_decodes] = _decode_ref(q[:num_decodes], kv_cache, seq_lens[:num_decodes],
                                        block_tables[:num_decodes], scale, lens_t,
                                        k_scale, v_scale, window, sinks)
    _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
             k_scale, v_scale, window, sinks)
    return out


def _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, first,
             k_scale, v_scale, window=0, sinks=None) -> None:
    for i in range(first, len(seq_lens)):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        out[s:e] = _extend_ref(q[s:e], kv_cache, seq_lens[i], block_tables[i], scale,
                               k_scale, v_scale, window, sinks)


def _combine_splits_ref(ml: torch.Tensor, acc: torch.Tensor,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    # ml [B, H, S, 2] (running max, sum), acc [B, H, S, D] unnormalised -> [B, H, D].
    # Split 0 always holds tokens, so the max over splits is finite; empty splits weigh 0.
    # A sink [H] is one more split: max the sink, sum 1, nothing accumulated.
    m, l_sum = ml[..., 0], ml[..., 1]
    top = m.amax(-1, keepdim=True)
    if sinks is not None:
        top = torch.maximum(top, sinks.float()[:, None])
    w = torch.exp(m - top)  # [B, H, S]
    den = (l_sum * w).sum(-1)
    if sinks is not None:
        den = den + torch.exp(sinks.float() - top[..., 0])
    return (acc * w[..., None]).sum(2) / den[..., None]

