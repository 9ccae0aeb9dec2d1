"""Paged attention over the KV cache: PyTorch references (CPU and any device) and Triton
kernels for decode and prefill/extend (CUDA, or Triton's interpreter in tests).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V),
in the model dtype or float8_e4m3fn. An fp8 cache holds K / k_scale and V / v_scale
(`ops/kv_quant.py`, written by `ops/kv_write.py`); every reader here takes the two scales
and dequantizes what it reads.

The kernels stream K/V in BLOCK_N-token tiles through a software-pipelined loop (num_stages - 1
tiles in flight); tile sizes, warps, pipeline depth and the decode split count are data
(`skyline/ops/configs/`, written by `bench/tune_attention.py`) over heuristic defaults, chosen
from shapes and the batch size only.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from skyline.ops.tuning import dtype_name, get_config, token_bucket


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    # cache [num_blocks, block_size, kvh, d] -> [n, kvh, d] for one sequence
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    return cache[block_table[:nblk].long()].flatten(0, 1)[:n]


def _decode_ref(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    kv_cache: torch.Tensor,
    seq_lens: list[int],  # [B]
    block_tables: torch.Tensor,  # [B, max_blocks]
    scale: float,
    seq_lens_tensor: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    # All one-token sequences as one padded batch.
    kc, vc = kv_cache[0], kv_cache[1]
    max_len = max(seq_lens)
    bs = kc.shape[1]
    nblk = (max_len + bs - 1) // bs
    table = block_tables[:, :nblk].long()  # [B, nblk]
    k = kc[table].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, kvh, L, d]
    v = vc[table].flatten(1, 2)[:, :max_len].transpose(1, 2)
    pos = torch.arange(max_len, device=q.device)
    # A host list copied to the GPU here would synchronise every layer; use the device copy.
    lens_t = seq_lens_tensor if seq_lens_tensor is not None else torch.tensor(
        seq_lens, device=q.device)
    valid = pos[None, :] < lens_t[:, None]  # [B, L]
    # Padded positions read whatever the padding blocks hold; zero them so a NaN left
    # there by another sequence cannot leak through 0 * NaN.
    k = k.to(q.dtype).masked_fill(~valid[:, None, :, None], 0)
    v = v.to(q.dtype).masked_fill(~valid[:, None, :, None], 0)
    # the fp8 scales, folded in: scores * k_scale, output * v_scale
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale * k_scale,
        enable_gqa=q.shape[1] != kc.shape[2],
    )
    return _times(o.squeeze(2), v_scale)


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
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    q_len = q.shape[0]
    gqa = q.shape[1] != kv_cache.shape[3]
    k = _gather(kv_cache[0], block_table, seq_len).transpose(0, 1).to(q.dtype)  # [kvh, n, d]
    v = _gather(kv_cache[1], block_table, seq_len).transpose(0, 1).to(q.dtype)
    qi = q.transpose(0, 1)  # [H, q_len, d]
    scale = scale * k_scale
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # query j sits at absolute position seq_len - q_len + j and sees keys up to it
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = qpos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]  # [q_len, n]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return _times(o.transpose(0, 1), v_scale)


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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its whole cached context.

    The new tokens of a sequence are its last q_len positions. Sequences [0, num_decodes)
    have one query token each and are computed as one padded batch. The cache holds
    K / k_scale and V / v_scale (kv_write.write_kv_ref).
    """
    out = torch.empty_like(q)
    if num_decodes:
        lens_t = None if seq_lens_tensor is None else seq_lens_tensor[:num_decodes]
        out[:num_decodes] = _decode_ref(q[:num_decodes], kv_cache, seq_lens[:num_decodes],
                                        block_tables[:num_decodes], scale, lens_t,
                                        k_scale, v_scale)
    _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
             k_scale, v_scale)
    return out


def _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, first,
             k_scale, v_scale) -> None:
    for i in range(first, len(seq_lens)):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        out[s:e] = _extend_ref(q[s:e], kv_cache, seq_lens[i], block_tables[i], scale,
                               k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    num_decodes: int = 0,
    seq_lens_tensor: torch.Tensor | None = None,
    query_start_loc_tensor: torch.Tensor | None = None,  # [num_seqs + 1] int32, on q's device
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """paged_attention_ref's contract; on CUDA, Triton kernels for decodes and for prefills."""
    if not (q.is_cuda and triton is not None and seq_lens_tensor is not None):
        return paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                                   num_decodes, seq_lens_tensor, k_scale, v_scale)
    out = torch.empty_like(q)
    if num_decodes:
        out[:num_decodes] = paged_decode_attention(
            q[:num_decodes], kv_cache, block_tables[:num_decodes],
            seq_lens_tensor[:num_decodes], scale, k_scale=k_scale, v_scale=v_scale)
    if len(seq_lens) == num_decodes:
        return out
    if query_start_loc_tensor is None:
        _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
                 k_scale, v_scale)
        return out
    t0 = query_start_loc[num_decodes]
    max_q = max(query_start_loc[i + 1] - query_start_loc[i]
                for i in range(num_decodes, len(seq_lens)))
    out[t0:] = paged_prefill_attention(
        q[t0:], kv_cache, query_start_loc_tensor[num_decodes:] - t0,
        seq_lens_tensor[num_decodes:], block_tables[num_decodes:], scale, max_q, k_scale, v_scale)
    return out


# ----------------------------------------------------------------------------------------
# Launch configurations: data from skyline/ops/configs/ (bench/tune_attention.py) over
# heuristic defaults. Chosen from shapes and the batch size only, never from device data, so
# a captured CUDA graph stays valid.

DECODE_KERNEL = "paged_decode"  # the kernels' names in the tuning tables
PREFILL_KERNEL = "paged_prefill"
STAGE_BYTES = 32 << 10  # K + V bytes of one tile in the defaults (x num_stages in shared memory)


def shape_key(num_heads: int, num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype,
              kv_dtype: torch.dtype) -> str:
    """Tuning-table key prefix of one attention shape, e.g. "h32x8:d128:p16:bf16:kv-bf16"."""
    kv = "fp8" if kv_dtype.itemsize == 1 else dtype_name(kv_dtype)
    return f"h{num_heads}x{num_kv_heads}:d{head_dim}:p{page}:{dtype_name(dtype)}:kv-{kv}"


def decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """KV splits per sequence: enough programs to fill the GPU twice when there are few
    sequences. Depends on the batch size only, so a captured CUDA graph stays valid."""
    return max(1, min(16, (2 * num_sms) // max(1, num_seqs * num_kv_heads)))


def _tile_n(head_dim: int, kv_itemsize: int) -> int:
    # the largest K/V tile (<= 64 tokens) whose K + V bytes fit STAGE_BYTES
    block_n, d_pad = 64, max(16, 1 << (head_dim - 1).bit_length())
    while block_n > 16 and 2 * block_n * d_pad * kv_itemsize > STAGE_BYTES:
        block_n //= 2
    return block_n


def default_decode_config(num_seqs: int, num_kv_heads: int, head_dim: int, kv_itemsize: int,
                          num_sms: int = 132) -> dict:
    """Decode launch configuration for shapes without a tuned entry: 64-token tiles (fewer
    when K + V would pass STAGE_BYTES), three pipeline stages, decode_splits."""
    return {"BLOCK_N": _tile_n(head_dim, kv_itemsize), "num_warps": 4, "num_stages": 3,
            "NUM_SPLITS": decode_splits(num_seqs, num_kv_heads, num_sms)}


def default_prefill_config(max_query_len: int, head_dim: int, kv_itemsize: int) -> dict:
    """Prefill launch configuration for shapes without a tuned entry."""
    return {"BLOCK_M": 64 if max_query_len >= 64 else 16,
            "BLOCK_N": _tile_n(head_dim, kv_itemsize), "num_warps": 4, "num_stages": 3}


def batch_bucket(num_seqs: int) -> int:
    """The largest power of two <= num_seqs: the batch sizes the tuner measures."""
    return 1 << (max(1, num_seqs).bit_length() - 1)


@functools.cache
def decode_config(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                  dtype: torch.dtype, kv_dtype: torch.dtype, num_sms: int = 132) -> dict:
    """The decode launch configuration: the tuned entry of the largest tuned batch size
    <= num_seqs (powers of two), else default_decode_config. A tuned split count keeps its
    number of programs: S splits tuned at b sequences become round(S * b / num_seqs) >= 1."""
    key = shape_key(num_heads, num_kv_heads, head_dim, page, dtype, kv_dtype)
    default = default_decode_config(num_seqs, num_kv_heads, head_dim, kv_dtype.itemsize,
                                    num_sms)
    b = batch_bucket(num_seqs)
    while b >= 1:
        found = get_config(DECODE_KERNEL, f"{key}:b{b}", {})
        if found:
            cfg = {**default, **found}
            if "NUM_SPLITS" in found:
                cfg["NUM_SPLITS"] = max(1, round(found["NUM_SPLITS"] * b / num_seqs))
            return cfg
        b //= 2
    return default


@functools.cache
def prefill_config(max_query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   page: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> dict:
    """The prefill launch configuration: the tuned entry for max_query_len's token bucket
    (tuning.token_bucket), else default_prefill_config."""
    key = shape_key(num_heads, num_kv_heads, head_dim, page, dtype, kv_dtype)
    default = default_prefill_config(max_query_len, head_dim, kv_dtype.itemsize)
    return get_config(PREFILL_KERNEL, f"{key}:q{token_bucket(max_query_len)}", default)


def _pipelined(cfg: dict) -> bool:
    # Compiled: a `for` over tl.range, software-pipelined num_stages deep. Triton's
    # interpreter cannot run range() to a runtime bound, so there (and for num_stages 1) the
    # kernels walk the same tiles with a while loop, which the compiler does not pipeline.
    return os.environ.get("TRITON_INTERPRET") != "1" and cfg["num_stages"] > 1


def _check(cfg: dict, kernel: str) -> None:
    need = ("BLOCK_M", "BLOCK_N") if kernel == PREFILL_KERNEL else ("BLOCK_N",)
    for name in need:
        n = cfg[name]
        if not (isinstance(n, int) and n >= 16 and n & (n - 1) == 0):
            raise ValueError(f"{kernel} config {cfg}: {name} must be a power of two >= 16")


# ----------------------------------------------------------------------------------------
# Triton: paged decode attention (one query token per sequence), GQA-aware.

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references above serve
    triton = None

if triton is not None:

    @triton.jit
    def _page_ids(block_tables_ptr, seq, pos, end, stride_bt, PAGE: tl.constexpr):
        # Page ids of context positions `pos` [N] (0 at positions >= end), in one vector load.
        # The loops below load the next tile's ids one tile ahead and carry them: the K/V loads
        # then depend on a loop-carried value rather than on a load in the same iteration, so
        # the pipeliner gives them all num_stages - 1 buffers (an indirect load in the same
        # iteration would take half the stages for itself).
        return tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE, mask=pos < end, other=0)

    @triton.jit
    def _load_kv_tile(k_ptr, v_ptr, blk, kvh, pos, valid, d, dmask, stride_kb, stride_ks,
                      stride_kh, PAGE: tl.constexpr, DTYPE: tl.constexpr):
        # K and V rows of context positions `pos` [N] on pages `blk` [N], converted to the
        # compute dtype DTYPE (exact from fp8 e4m3; the kernels apply the fp8 scales to scores
        # and output, not to each element).
        row = blk.to(tl.int64) * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        return k.to(DTYPE), v.to(DTYPE)

    @triton.jit
    def _attend_tile(q, k, v, see, m, l_sum, acc, scale, IEEE: tl.constexpr):
        # One online-softmax step of queries q [R, D] over keys k / values v [N, D], where
        # see [R, N] says which keys each query may attend to. Returns the new (m, l_sum, acc).
        if IEEE:  # fp32: exact, not the tensor cores' tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(see, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # rows that see nothing yet keep m = -inf; shift by 0 there to avoid inf - inf
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_sum, acc

    @triton.jit
    def _decode_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, blk, start, end, offs, d,
                     dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks, stride_kh,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # The decode loop body: context positions [start, start + BLOCK_N) on pages `blk`.
        # Returns the new (m, l_sum, acc) and the next tile's page ids.
        pos = start + offs
        valid = pos < end
        blk_next = _page_ids(block_tables_ptr, seq, pos + BLOCK_N, end, stride_bt, PAGE)
        k, v = _load_kv_tile(k_ptr, v_ptr, blk, kvh, pos, valid, d, dmask, stride_kb, stride_ks,
                             stride_kh, PAGE, q_ptr.dtype.element_ty)
        m, l_sum, acc = _attend_tile(q, k, v, valid[None, :], m, l_sum, acc, scale, IEEE)
        return m, l_sum, acc, blk_next

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, part_ml_ptr, part_acc_ptr, block_tables_ptr, seq_lens_ptr,
        scale, v_scale, num_heads, num_splits,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ob, stride_oh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        SPLIT: tl.constexpr, PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        # One program per (sequence, kv head, KV split): all GROUP query heads sharing that kv
        # head read each K/V tile once. Online softmax over BLOCK_N-token tiles gathered via the
        # table. With SPLIT (flash-decoding), each of the num_splits programs of a sequence
        # covers one slice of the context and writes its partial (max, sum, acc) for
        # _combine_splits. `scale` includes the fp8 k_scale; v_scale multiplies the output.
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G, D]
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        if SPLIT:
            per = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
            start = split * per
            end = tl.minimum(seq_len, start + per)
        else:
            start = 0
            end = seq_len
        blk = _page_ids(block_tables_ptr, seq, start + offs, end, stride_bt, PAGE)
        if PIPELINE:
            for tile in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
                m, l_sum, acc, blk = _decode_tile(
                    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, blk, tile, end, offs, d,
                    dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks, stride_kh,
                    PAGE, BLOCK_N, IEEE)
        else:
            while start < end:
                m, l_sum, acc, blk = _decode_tile(
                    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, blk, start, end, offs, d,
                    dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks, stride_kh,
                    PAGE, BLOCK_N, IEEE)
                start += BLOCK_N
        acc = acc * v_scale
        if SPLIT:
            part = (seq * num_heads + heads) * num_splits + split  # [G] rows of [B, H, S]
            tl.store(part_ml_ptr + part * 2, m, mask=gmask)
            tl.store(part_ml_ptr + part * 2 + 1, l_sum, mask=gmask)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=gmask[:, None] & dmask[None, :])
        else:
            out = acc / l_sum[:, None]
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


    @triton.jit
    def _combine_splits_kernel(
        ml_ptr, acc_ptr, out_ptr, num_heads, stride_ob, stride_oh,
        NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
    ):
        # One program per (sequence, head): _combine_splits_ref in one launch.
        row = tl.program_id(0)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        smask = s < NUM_SPLITS
        base = row * NUM_SPLITS + s
        m = tl.load(ml_ptr + base * 2, mask=smask, other=float("-inf"))
        l_sum = tl.load(ml_ptr + base * 2 + 1, mask=smask, other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # [S]
        acc = tl.load(acc_ptr + base[:, None] * HEAD_DIM + d[None, :],
                      mask=smask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [S, D]
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
        seq, head = row // num_heads, row % num_heads
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _combine_splits_ref(ml: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    # ml [B, H, S, 2] (running max, sum), acc [B, H, S, D] unnormalised -> [B, H, D].
    # Split 0 always holds tokens, so the max over splits is finite; empty splits weigh 0.
    m, l_sum = ml[..., 0], ml[..., 1]
    w = torch.exp(m - m.amax(-1, keepdim=True))  # [B, H, S]
    return (acc * w[..., None]).sum(2) / (l_sum * w).sum(-1)[..., None]


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    num_splits: int | None = None,  # None: the configuration's NUM_SPLITS
    k_scale: float = 1.0,  # fp8 cache: the layer's K and V scales
    v_scale: float = 1.0,
    config: dict | None = None,  # None: decode_config (tuned, else the default)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = q.shape
    _, _, page, kvh, _ = kv_cache.shape
    group = num_heads // kvh
    if config is None:
        sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 132)
        config = decode_config(num_seqs, num_heads, kvh, head_dim, page, q.dtype,
                               kv_cache.dtype, sms)
    _check(config, DECODE_KERNEL)
    if num_splits is None:
        num_splits = config["NUM_SPLITS"]
    out = torch.empty_like(q)
    ml = acc = out  # unused unless split
    if num_splits > 1:
        ml = torch.empty(num_seqs, num_heads, num_splits, 2, device=q.device, dtype=torch.float32)
        acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=q.device,
                          dtype=torch.float32)
    k, v = kv_cache[0], kv_cache[1]
    d_pad = max(16, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(num_seqs, kvh, num_splits)](
        q, k, v, out, ml, acc, block_tables, seq_lens, scale * k_scale, v_scale, num_heads,
        num_splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=d_pad, PAGE=page, BLOCK_N=config["BLOCK_N"], IEEE=q.dtype == torch.float32,
        SPLIT=num_splits > 1, PIPELINE=_pipelined(config), NUM_STAGES=config["num_stages"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs * num_heads,)](
            ml, acc, out, num_heads, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
            S_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim, D_PAD=d_pad,
            num_warps=1,
        )
    return out


# ----------------------------------------------------------------------------------------
# Triton: paged prefill / extend attention (many query tokens per sequence, causal, over a
# cached prefix), variable lengths in one launch. Reference: _extend_ref.

if triton is not None:

    @triton.jit
    def _prefill_tile(q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, q_pos, blk, start, end,
                      offs, d, dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks,
                      stride_kh, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        # The prefill loop body: context positions [start, start + BLOCK_N) on pages `blk`.
        # Returns the new (m, l_sum, acc) and the next tile's page ids.
        pos = start + offs
        valid = pos < end
        blk_next = _page_ids(block_tables_ptr, seq, pos + BLOCK_N, end, stride_bt, PAGE)
        k, v = _load_kv_tile(k_ptr, v_ptr, blk, kvh, pos, valid, d, dmask, stride_kb, stride_ks,
                             stride_kh, PAGE, q_ptr.dtype.element_ty)
        see = valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal, [M, N]
        m, l_sum, acc = _attend_tile(q, k, v, see, m, l_sum, acc, scale, IEEE)
        return m, l_sum, acc, blk_next

    @triton.jit
    def _paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, scale, v_scale,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        PIPELINE: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        # One program per (sequence, query head, tile of BLOCK_M query tokens). Query j of a
        # sequence sits at absolute position seq_len - q_len + j and sees keys up to it.
        # Tiles run last first: the last tiles of a causal prefill see the most keys, so the
        # long programs start first and the short ones fill the tail.
        # `scale` includes the fp8 k_scale; v_scale multiplies the accumulated output.
        seq = tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        kvh = head // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = seq_len - q_len + rows  # [M]
        d = tl.arange(0, D_PAD)
        dmask = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)  # [M, D]
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        # keys this tile can see: up to its last query's position (tiles past q_len see none)
        end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
        end = tl.where(tile * BLOCK_M < q_len, end, 0)
        blk = _page_ids(block_tables_ptr, seq, offs, end, stride_bt, PAGE)
        if PIPELINE:
            for start in tl.range(0, end, BLOCK_N, num_stages=NUM_STAGES):
                m, l_sum, acc, blk = _prefill_tile(
                    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, q_pos, blk, start, end,
                    offs, d, dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks,
                    stride_kh, PAGE, BLOCK_N, IEEE)
        else:
            start = 0
            while start < end:
                m, l_sum, acc, blk = _prefill_tile(
                    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq, kvh, q, q_pos, blk, start, end,
                    offs, d, dmask, m, l_sum, acc, scale, stride_bt, stride_kb, stride_ks,
                    stride_kh, PAGE, BLOCK_N, IEEE)
                start += BLOCK_N
        out = acc * v_scale / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences' new tokens back to back
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, into q
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    max_query_len: int,
    k_scale: float = 1.0,  # fp8 cache: the layer's K and V scales
    v_scale: float = 1.0,
    config: dict | None = None,  # None: prefill_config (tuned, else the default)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    _, num_heads, head_dim = q.shape
    _, _, page, kvh, _ = kv_cache.shape
    if config is None:
        config = prefill_config(max_query_len, num_heads, kvh, head_dim, page, q.dtype,
                                kv_cache.dtype)
    _check(config, PREFILL_KERNEL)
    out = torch.empty_like(q)
    k, v = kv_cache[0], kv_cache[1]
    block_m = config["BLOCK_M"]
    grid = (seq_lens.shape[0], num_heads, triton.cdiv(max_query_len, block_m))
    _paged_prefill_kernel[grid](
        q, k, v, out, block_tables, seq_lens, query_start_loc, scale * k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kvh, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page, BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], IEEE=q.dtype == torch.float32,
        PIPELINE=_pipelined(config), NUM_STAGES=config["num_stages"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out
