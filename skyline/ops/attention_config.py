"""Launch configurations of the paged attention kernels (ops/attention.py): heuristic
defaults, and the tuned tables (`skyline/ops/configs/attention-*.json`, written by
`bench/kernels/tune_attention.py`) looked up by shape and batch size only, so a captured CUDA graph
stays valid."""

from __future__ import annotations

import functools

import torch

from skyline.ops.triton_utils import interpreted
from skyline.ops.tuning import dtype_name, get_config, token_bucket

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


# An fp8 cache decoding at least this many sequences on a GPU with fp8 units (the kernels'
# PTX conversion): 32-token tiles in one warp a program, what tuning chose on both the H200 and
# the H100 at 256 to 1,024 sequences (attention tables; on the H100 0.84-0.88 -> 0.89-0.96 of
# the copy-bandwidth floor, BENCHMARKS.md).
FP8_ONE_WARP_SEQS = 256


def default_decode_config(num_seqs: int, num_kv_heads: int, head_dim: int, kv_itemsize: int,
                          num_sms: int = 132, fp8_units: bool = False) -> dict:
    """Decode launch configuration for shapes without a tuned entry: 64-token tiles (fewer
    when K + V would pass STAGE_BYTES), four warps, three pipeline stages, decode_splits;
    an fp8 cache at FP8_ONE_WARP_SEQS sequences or more on a GPU with fp8 units, 32-token
    tiles in one warp."""
    splits = decode_splits(num_seqs, num_kv_heads, num_sms)
    if kv_itemsize == 1 and fp8_units and num_seqs >= FP8_ONE_WARP_SEQS:
        return {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "NUM_SPLITS": splits}
    return {"BLOCK_N": _tile_n(head_dim, kv_itemsize), "num_warps": 4, "num_stages": 3,
            "NUM_SPLITS": splits}


def default_prefill_config(max_query_len: int, head_dim: int, kv_itemsize: int) -> dict:
    """Prefill launch configuration for shapes without a tuned entry."""
    return {"BLOCK_M": 64 if max_query_len >= 64 else 16,
            "BLOCK_N": _tile_n(head_dim, kv_itemsize), "num_warps": 4, "num_stages": 3}


def batch_bucket(num_seqs: int) -> int:
    """The largest power of two <= num_seqs: the batch sizes the tuner measures."""
    return 1 << (max(1, num_seqs).bit_length() - 1)


@functools.cache
def decode_config(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, page: int,
                  dtype: torch.dtype, kv_dtype: torch.dtype, num_sms: int = 132,
                  fp8_units: bool = False) -> dict:
    """The decode launch configuration: the tuned entry of the largest tuned batch size
    <= num_seqs (powers of two), else default_decode_config. A tuned split count keeps its
    number of programs: S splits tuned at b sequences become round(S * b / num_seqs) >= 1."""
    key = shape_key(num_heads, num_kv_heads, head_dim, page, dtype, kv_dtype)
    default = default_decode_config(num_seqs, num_kv_heads, head_dim, kv_dtype.itemsize,
                                    num_sms, fp8_units)
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
    return not interpreted() and cfg["num_stages"] > 1


def _check(cfg: dict, kernel: str) -> None:
    need = ("BLOCK_M", "BLOCK_N") if kernel == PREFILL_KERNEL else ("BLOCK_N",)
    for name in need:
        n = cfg[name]
        if not (isinstance(n, int) and n >= 16 and n & (n - 1) == 0):
            raise ValueError(f"{kernel} config {cfg}: {name} must be a power of two >= 16")
