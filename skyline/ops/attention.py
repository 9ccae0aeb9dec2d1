"""Paged attention over the KV cache: the dispatch between the PyTorch references (CPU and
any device; in ops/attention_ref.py, re-exported here) and the launchers of the Triton kernels
for decode and prefill/extend (CUDA, or Triton's interpreter in tests; kernels in
ops/attention_triton.py and ops/attention_prefill_triton.py, launch configurations in
ops/attention_config.py), and of both together for a mixed step whose launch depends on its
token and sequence counts only (`paged_mixed_attention`, for CUDA graphs of mixed steps).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V),
in the model dtype or float8_e4m3fn. An fp8 cache holds K / k_scale and V / v_scale
(`ops/kv_quant.py`, written by `ops/kv_write.py`); every reader here takes the two scales
and dequantizes what it reads.

The kernels stream K/V in BLOCK_N-token tiles through a software-pipelined loop (num_stages - 1
tiles in flight); tile sizes, warps, pipeline depth and the decode split count are data
(`skyline/ops/configs/`, written by `bench/kernels/tune_attention.py`) over heuristic defaults,
chosen from shapes and the batch size only.
"""

from __future__ import annotations

import torch

from skyline.ops import attention_prefill_triton as prefill_kernels
from skyline.ops import attention_triton as kernels
from skyline.ops.attention_config import (  # noqa: F401  (re-exported: tests, bench)
    DECODE_KERNEL,
    PREFILL_KERNEL,
    _check,
    _pipelined,
    batch_bucket,
    decode_config,
    decode_splits,
    default_decode_config,
    default_prefill_config,
    prefill_config,
    shape_key,
)
from skyline.ops.attention_dense import dense_extend, long_extends
from skyline.ops.attention_ref import (  # noqa: F401  (re-exported: the model, tests)
    ATTEND_CHUNK,
    SMALL_EXTEND,
    _extends,
    attend_ref,
    causal_mask,
    paged_attention_ref,
)
from skyline.ops.cpu_attention import DecodeGather, decode_attention_cpu, decode_gather
from skyline.ops.fp8_linear import has_fp8_units
from skyline.ops.gemv_int_a8 import CHUNK, INT8_MAX, Int8Chunks
from skyline.ops.pdl import use_pdl
from skyline.ops.triton_utils import interpreted, triton


def _paged_attention_cpu(q, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                         num_decodes, seq_lens_tensor, k_scale, v_scale,
                         gather: DecodeGather | None) -> torch.Tensor:
    # paged_attention_ref's contract, its decodes in a few operations (ops/cpu_attention.py)
    if gather is None:
        lens_t = None if seq_lens_tensor is None else seq_lens_tensor[:num_decodes]
        gather = decode_gather(seq_lens[:num_decodes], block_tables[:num_decodes],
                               kv_cache.shape[2], lens_t)
    if num_decodes == len(seq_lens):
        return decode_attention_cpu(q, kv_cache, gather, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    out[:num_decodes] = decode_attention_cpu(q[:num_decodes], kv_cache, gather, scale, k_scale,
                                             v_scale)
    _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
             k_scale, v_scale)
    return out


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
    int8_out: bool = False,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    cpu_gather: DecodeGather | None = None,  # CPU: the decodes' gather, made once per step
    mixed: bool = False,  # the host lists are not this step's: see paged_mixed_attention
) -> torch.Tensor | Int8Chunks:
    """paged_attention_ref's contract; on CUDA, Triton kernels for decodes and for prefills.
    With `int8_out`, a pure decode batch whose splits are combined by a kernel (and a head
    size that is a power of two and a multiple of 32) returns [T, H * D] rounded for the W4A8
    GEMV, as Int8Chunks, from that kernel; otherwise the plain output. With `mixed` (a CUDA
    graph's mixed step) only the device tensors describe the step: paged_mixed_attention."""
    if mixed:
        assert seq_lens_tensor is not None and query_start_loc_tensor is not None
        return paged_mixed_attention(q, kv_cache, query_start_loc_tensor, seq_lens_tensor,
                                     block_tables, scale, k_scale, v_scale, window=window,
                                     sinks=sinks)
    if not (q.is_cuda and triton is not None and seq_lens_tensor is not None):
        # the CPU's few-operation decodes take full causal attention without sinks only
        if q.device.type == "cpu" and num_decodes and not window and sinks is None:
            return _paged_attention_cpu(q, kv_cache, query_start_loc, seq_lens, block_tables,
                                        scale, num_decodes, seq_lens_tensor, k_scale, v_scale,
                                        cpu_gather)
        return paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                                   num_decodes, seq_lens_tensor, k_scale, v_scale, window, sinks)
    if len(seq_lens) == num_decodes:  # a pure decode batch
        return paged_decode_attention(q, kv_cache, block_tables, seq_lens_tensor, scale,
                                      k_scale=k_scale, v_scale=v_scale, int8_out=int8_out,
                                      window=window, sinks=sinks)
    out = torch.empty_like(q)
    if num_decodes:
        paged_decode_attention(q[:num_decodes], kv_cache, block_tables[:num_decodes],
                               seq_lens_tensor[:num_decodes], scale, k_scale=k_scale,
                               v_scale=v_scale, out=out[:num_decodes], window=window,
                               sinks=sinks)
    if query_start_loc_tensor is None:
        _extends(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, num_decodes,
                 k_scale, v_scale, window, sinks)
        return out
    extends = range(num_decodes, len(seq_lens))
    dense = long_extends(q, kv_cache, query_start_loc, seq_lens, extends, window, sinks)
    if dense:  # long chunks through the dense kernel, the other extends as a batch of their own
        for i in dense:
            a, b = query_start_loc[i], query_start_loc[i + 1]
            out[a:b] = dense_extend(q[a:b], kv_cache, block_tables[i], seq_lens[i], scale,
                                    k_scale, v_scale)
        rest = [i for i in extends if i not in dense]
        if rest:
            _paged_subset(q, out, kv_cache, query_start_loc, seq_lens_tensor, block_tables, rest,
                          scale, k_scale, v_scale)
        return out
    t0 = query_start_loc[num_decodes]
    max_q = max(query_start_loc[i + 1] - query_start_loc[i]
                for i in range(num_decodes, len(seq_lens)))
    out[t0:] = paged_prefill_attention(
        q[t0:], kv_cache, query_start_loc_tensor[num_decodes:] - t0,
        seq_lens_tensor[num_decodes:], block_tables[num_decodes:], scale, max_q, k_scale, v_scale,
        window=window, sinks=sinks)
    return out


def _paged_subset(q, out, kv_cache, query_start_loc, seq_lens_tensor, block_tables,
                  seqs: list[int], scale, k_scale, v_scale) -> None:
    # extends `seqs` through the paged prefill kernel, their rows gathered into a batch
    rows = [r for i in seqs for r in range(query_start_loc[i], query_start_loc[i + 1])]
    loc = [0]
    for i in seqs:
        loc.append(loc[-1] + query_start_loc[i + 1] - query_start_loc[i])
    dev = q.device
    sel = torch.tensor(seqs, device=dev)
    r = torch.tensor(rows, device=dev)
    out[r] = paged_prefill_attention(
        q[r], kv_cache, torch.tensor(loc, dtype=torch.int32, device=dev), seq_lens_tensor[sel],
        block_tables[sel], scale, max(loc[j + 1] - loc[j] for j in range(len(seqs))), k_scale,
        v_scale)


# ----------------------------------------------------------------------------------------
# Triton: paged decode attention (one query token per sequence, the context in splits).
# Reference: _decode_ref (ops/attention_ref.py).


# The window the kernels take for full attention: longer than any context.
NO_WINDOW = 1 << 30


def _f16_tiles(q: torch.Tensor, k: torch.Tensor) -> bool:
    # an fp8 cache under bf16 queries: the kernels compute their tiles in fp16 (_query_dtype)
    return k.dtype.itemsize == 1 and q.dtype == torch.bfloat16


def _fp8_words(k: torch.Tensor, head_dim: int) -> int:
    # an fp8 cache is read as int32 words (attention_triton._load_kv_tile): 2 when compiled
    # (PTX conversion, sm_89 and later), 1 in Triton's interpreter; 0 for other caches
    if k.dtype.itemsize != 1 or head_dim % 4:
        return 0
    if interpreted():
        return 1
    return 2 if k.is_cuda and has_fp8_units(k.device) else 0


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
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim] to write; None: new
    int8_out: bool = False,  # see paged_attention
    window: int = 0,  # sliding window (paged_attention_ref); 0: the whole context
    sinks: torch.Tensor | None = None,  # [num_heads] float32 (paged_attention_ref)
    # [num_seqs + 1] int32: q and out rows are tokens, sequence i's at query_start_loc[i]; the
    # sequences without exactly one query token are skipped (paged_mixed_attention)
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor | Int8Chunks:  # [num_seqs, num_heads, head_dim]
    _, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    varlen = query_start_loc is not None
    _, _, page, kvh, _ = kv_cache.shape
    group = num_heads // kvh
    if config is None:
        sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 132)
        config = decode_config(num_seqs, num_heads, kvh, head_dim, page, q.dtype,
                               kv_cache.dtype, sms, q.is_cuda and has_fp8_units(q.device))
    _check(config, DECODE_KERNEL)
    if num_splits is None:
        num_splits = config["NUM_SPLITS"]
        if window:  # splits past the window's tiles would hold nothing
            num_splits = max(1, min(num_splits, -(-window // config["BLOCK_N"])))
    if out is None:
        out = torch.empty_like(q)
    ml = acc = out  # unused unless split
    if num_splits > 1:
        ml = torch.empty(num_seqs, num_heads, num_splits, 2, device=q.device, dtype=torch.float32)
        acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=q.device,
                          dtype=torch.float32)
    k, v = kv_cache[0], kv_cache[1]
    d_pad = max(16, triton.next_power_of_2(head_dim))
    pdl = use_pdl(q.device)
    kernels.paged_decode_kernel[(num_seqs, kvh, num_splits)](
        q, k, v, out, ml, acc, block_tables, seq_lens, scale * k_scale, v_scale, num_heads,
        num_splits, window or NO_WINDOW, q if sinks is None else sinks,
        query_start_loc if varlen else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=d_pad, PAGE=page, BLOCK_N=config["BLOCK_N"], IEEE=q.dtype == torch.float32,
        SPLIT=num_splits > 1, PIPELINE=_pipelined(config), NUM_STAGES=config["num_stages"],
        F16=_f16_tiles(q, k), PDL=pdl, FP8_WORDS=_fp8_words(k, head_dim),
        SINKS=sinks is not None and num_splits == 1, VARLEN=varlen,
        num_warps=config["num_warps"], num_stages=config["num_stages"], launch_pdl=pdl,
    )
    rounded = None
    if int8_out and not varlen and num_splits > 1 and head_dim == d_pad and head_dim % CHUNK == 0:
        rounded = Int8Chunks.empty(num_seqs, num_heads * head_dim, out.dtype, q.device)
    if num_splits > 1:
        kernels.combine_splits_kernel[(num_seqs * num_heads,)](
            ml, acc, out, num_heads, out.stride(0), out.stride(1), num_splits=num_splits,
            S_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim, D_PAD=d_pad,
            PDL=pdl, num_seqs=num_seqs, words_ptr=rounded and rounded.words,
            floats_ptr=rounded and rounded.floats, INT8_OUT=rounded is not None,
            INT8_MAX=INT8_MAX, sinks_ptr=sinks, SINKS=sinks is not None,
            qsl_ptr=query_start_loc, VARLEN=varlen, num_warps=1, launch_pdl=pdl,
        )
    return out if rounded is None else rounded


# ----------------------------------------------------------------------------------------
# Triton: paged prefill / extend attention (many query tokens per sequence, causal, over a
# cached prefix), variable lengths in one launch. Reference: _extend_ref
# (ops/attention_ref.py).


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
    window: int = 0,  # sliding window (paged_attention_ref); 0: the whole context
    sinks: torch.Tensor | None = None,  # [num_heads] float32 (paged_attention_ref)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    _, num_heads, head_dim = q.shape
    _, _, page, kvh, _ = kv_cache.shape
    if config is None:
        config = prefill_config(max_query_len, num_heads, kvh, head_dim, page, q.dtype,
                                kv_cache.dtype)
    _check(config, PREFILL_KERNEL)
    out = torch.empty_like(q)
    # PACK query heads of one kv head per program (1, or the whole group): BLOCK_M is then
    # in tokens, and the program's tile has BLOCK_M * PACK_PAD rows.
    pack = _pack(config, num_heads, kvh)
    grid = (seq_lens.shape[0], num_heads // pack, triton.cdiv(max_query_len, config["BLOCK_M"]))
    _launch_prefill(prefill_kernels.paged_prefill_kernel, grid, (), {}, q, kv_cache, out,
                    query_start_loc, seq_lens, block_tables, scale, config, k_scale, v_scale,
                    window, sinks)
    return out


def _pack(config: dict, num_heads: int, kvh: int) -> int:
    return num_heads // kvh if config.get("PACK", 1) > 1 else 1


def _launch_prefill(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict,
                    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, config: dict, k_scale: float,
                    v_scale: float, window: int, sinks: torch.Tensor | None) -> None:
    # the arguments both prefill kernels take; `args` and `constexprs` are a kernel's own
    _, num_heads, head_dim = q.shape
    kvh = kv_cache.shape[3]
    pack = _pack(config, num_heads, kvh)
    k, v = kv_cache[0], kv_cache[1]
    pdl = use_pdl(q.device)
    kernel[grid](
        q, k, v, out, block_tables, seq_lens, query_start_loc, scale * k_scale, v_scale,
        window or NO_WINDOW, q if sinks is None else sinks, *args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kvh, HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE=kv_cache.shape[2], BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        IEEE=q.dtype == torch.float32, PIPELINE=_pipelined(config),
        NUM_STAGES=config["num_stages"], F16=_f16_tiles(q, k), PDL=pdl,
        FP8_WORDS=_fp8_words(k, head_dim), PACK=pack, PACK_PAD=triton.next_power_of_2(pack),
        SINKS=sinks is not None, **constexprs,
        num_warps=config["num_warps"], num_stages=config["num_stages"], launch_pdl=pdl,
    )


# ----------------------------------------------------------------------------------------
# Triton: a mixed step (decodes and extends in any order, and padding sequences of no query
# tokens) launched from its token and sequence counts alone, as a CUDA graph replays it.
# Reference: paged_attention_ref with num_decodes 0 (a one-token extend is a decode).


# Programs of the mixed step's prefill kernel beyond one per BLOCK_M tokens: a step of up to
# this many extends (prompt chunks beside the decodes, verifications) runs each query tile in a
# program of its own; one of more runs some tiles in turn.
MIXED_EXTENDS = 16


def paged_mixed_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences' new tokens back to back
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, into q; padding: no tokens
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    k_scale: float = 1.0,  # fp8 cache: the layer's K and V scales
    v_scale: float = 1.0,
    decode_cfg: dict | None = None,  # None: decode_config for min(num_seqs, num_tokens)
    prefill_cfg: dict | None = None,  # None: prefill_config for a num_tokens-token query
    window: int = 0,  # sliding window (paged_attention_ref); 0: the whole context
    sinks: torch.Tensor | None = None,  # [num_heads] float32 (paged_attention_ref)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention_ref's contract for any mix of sequences, read from the device tensors
    only: the launches depend on num_tokens and num_seqs, never on the sequences' lengths, so
    one CUDA graph replays every step of those counts. Sequences of one query token run in
    the decode kernel (its row through query_start_loc; the tiles and KV splits of a decode
    batch of num_seqs), the others in the prefill kernel over a flattened list of query tiles
    numbered on the device (paged_prefill_varlen_kernel: the same program per tile as
    paged_prefill_kernel). Rows of tokens that belong to no sequence are left unwritten.

    Why not every sequence through the flattened kernel: a decode there fills a tile of
    BLOCK_M x PACK rows (at least 16) with its one token's GROUP heads and reads its context
    without splits, where the decode kernel packs the GROUP heads into one 16-row tile and
    splits short batches' contexts; a decode's numbers would also differ between a mixed
    step and a decode step, which take the decode kernel."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, page, kvh, _ = kv_cache.shape
    # Every sequence with query tokens is among the first num_tokens (each before it has one):
    # the launches cover no more, so a graph of max_num_seqs sequences and fewer tokens does
    # not launch a program per padding sequence.
    num_seqs = min(seq_lens.shape[0], num_tokens)
    seq_lens, block_tables = seq_lens[:num_seqs], block_tables[:num_seqs]
    query_start_loc = query_start_loc[: num_seqs + 1]
    out = torch.empty_like(q)
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, k_scale=k_scale,
                           v_scale=v_scale, config=decode_cfg, out=out, window=window,
                           sinks=sinks, query_start_loc=query_start_loc)
    if prefill_cfg is None:
        prefill_cfg = prefill_config(num_tokens, num_heads, kvh, head_dim, page, q.dtype,
                                     kv_cache.dtype)
    _check(prefill_cfg, PREFILL_KERNEL)
    pack = _pack(prefill_cfg, num_heads, kvh)
    # E extends of T tokens have fewer than T / BLOCK_M + E tiles: one program each as far as
    # MIXED_EXTENDS extends
    grid = (triton.cdiv(num_tokens, prefill_cfg["BLOCK_M"]) + min(num_seqs, MIXED_EXTENDS),
            num_heads // pack)
    _launch_prefill(prefill_kernels.paged_prefill_varlen_kernel, grid, (num_seqs,),
                    {"S_PAD": max(2, triton.next_power_of_2(num_seqs))}, q, kv_cache, out,
                    query_start_loc, seq_lens, block_tables, scale, prefill_cfg, k_scale,
                    v_scale, window, sinks)
    return out
