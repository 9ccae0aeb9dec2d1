"""Small-batch GEMV of group-wise INT4 weights against int8 activations (W4A8), by `dp4a`.

At one row of x the INT4 GEMV on the tensor cores (gemv_quant.py) streams its weights at only
~0.3 of the copy bandwidth: the MMA wants each weight tile in its operand layout, so every tile
goes through shared memory (Nsight Compute: L1/shared at 0.74 of its peak, DRAM at 0.30). This
kernel keeps the weights in registers, in the layout they are loaded in. x comes rounded to
int8, one float scale per row and 32 columns (as llama.cpp's q8_1 for its quantized GEMVs), from
the kernel that makes it (RMSNorm, SiLU-and-mul: Int8Chunks) or from a small kernel of its own
(round_to_int8_chunks); then each int32 word of weights (eight nibbles) meets two words of x in one
PTX routine: two masks and a shift split it into its four low and four high nibbles, and two
`dp4a` multiply them by the matching int8 values of x and add, exactly, in int32. The four
words of a 32-column chunk add up in int32, then scale[n, g] * (dot * x_scale - zero[n, g] *
x_scale * sum(x_q over the chunk)) joins a float32 sum: per chunk, one scale, zero, x scale and
x sum, each loaded in the layout of the words they meet (the scales row-major, as the Linear
holds them: stored group-major they would be loaded along N and change layout through shared
memory on every K tile).

Nibble i of word j of a row is element 8j + i (int_matmul.py's layout), so the low nibbles of a
word are its even elements and the high nibbles its odd ones; x's words are formed from the even
(`xa`) and the odd (`xb`) elements of each 8. Rounding of x: v = x * (127 / amax) with the
chunk's amax (IEEE divisions), q = trunc(v + 0.5 sign(v)) (half away from zero); the chunk's
scale is amax / 127.

Numerics: the weights' values are those of the weight-only GEMV; x loses what int8 with
32-column scales loses (up to 1/254 of the chunk's amax per element). Accumulation: exact int32
per chunk, float32 across chunks and splits. Launch configurations: tuning tables, kernel
"gemv_int4a8", over `default_config`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from skyline.ops import gemv_int_a8_triton as kernels
from skyline.ops.fp8_quant import absmax_scales_ref
from skyline.ops.gemv import _cdiv, gemv_rows, row_bucket, split_k_plan
from skyline.ops.gemv_quant import config_key
from skyline.ops.pdl import use_pdl
from skyline.ops.triton_utils import inline_ptx, interpreted, triton
from skyline.ops.tuning import get_config

KERNEL = "gemv_int4a8"
_XQ = 16  # 32-column chunks of x per program of the quantization kernel
CHUNK = 32  # columns of x per int8 scale
INT8_MAX = 127.0


class Int8Chunks(NamedTuple):
    """Activations [M, cols] rounded for the W4A8 GEMV, as quantize_chunks_int8_ref rounds them:
    words int32 [2, M, 4 cdiv(cols, 32)] (per word of 8 columns, its even then its odd elements,
    one byte each), floats float32 [M, cdiv(cols, 32), 2] (per chunk of 32 columns, the scale and
    the scale times the chunk's sum of codes); the dtype the activations had, which the product
    returns. Made by the kernel that produces the activations when the Linear that consumes them
    asks for it (Linear.input_quant), or by round_to_int8_chunks."""

    words: torch.Tensor
    floats: torch.Tensor
    dtype: torch.dtype
    cols: int

    @classmethod
    def empty(cls, rows: int, cols: int, dtype: torch.dtype, device: torch.device
              ) -> Int8Chunks:
        """Uninitialised buffers for `rows` x `cols` activations, for a kernel to fill."""
        kc = _cdiv(cols, CHUNK)
        return cls(torch.empty(2, rows, kc * 4, dtype=torch.int32, device=device),
                   torch.empty(rows, kc, 2, dtype=torch.float32, device=device), dtype, cols)


def int8_chunks_ref(x: torch.Tensor) -> Int8Chunks:
    """x [M, K] rounded by the reference, in Int8Chunks' layout."""
    m, k = x.shape
    q, scale = quantize_chunks_int8_ref(x)
    kc = scale.shape[1]
    q = torch.nn.functional.pad(q, (0, kc * CHUNK - k)).long().view(m, kc * 4, 4, 2)
    shifts = torch.arange(4, device=x.device) * 8
    planes = ((q & 0xFF) << shifts[:, None]).sum(2)  # [M, words, 2]: even, odd
    planes = torch.where(planes >= 2**31, planes - 2**32, planes).to(torch.int32)
    sums = q.view(m, kc, CHUNK).sum(-1).float() * scale
    return Int8Chunks(planes.permute(2, 0, 1).contiguous(), torch.stack([scale, sums], -1),
                      x.dtype, k)


def quantize_chunks_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K] as int32, float32 scales [M, cdiv(K, 32)]) as the kernel
    rounds them: per row and 32 columns, x * (127 / amax) rounded half away from zero, scale
    amax / 127 (1 for an all-zero chunk)."""
    m, k = x.shape
    xt = torch.nn.functional.pad(x.float(), (0, -k % CHUNK)).view(m, -1, CHUNK)
    scale, inv = absmax_scales_ref(xt.abs().amax(-1, keepdim=True), INT8_MAX)
    v = xt * inv
    q = torch.trunc(v + torch.where(v < 0, -0.5, 0.5)).clamp(-127, 127).to(torch.int32)
    return q.view(m, -1)[:, :k], scale.view(m, -1)


def int4_gemv_a8_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, group: int, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x [..., K] rounded as the kernel rounds it, times the INT4 weights of ops/int_matmul.py's
    layout (float64 sums) -> [..., N] in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    q, sx = quantize_chunks_int8_ref(x2)
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).flatten(-2)[:, :k].double()
    g = torch.arange(k, device=x.device) // group
    w = (codes - zeros.double()[:, g]) * scales.double()[:, g]
    xd = q.double() * sx.double().repeat_interleave(CHUNK, dim=1)[:, :k]
    y = xd @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Tiles of 4 rows and up to 4,096 columns (2 KiB of each row), a warp per 1,024 columns
    (one chunk of 32 per thread), with K split while there are fewer programs than SMs and each
    split keeps at least two K tiles; no loads ahead."""
    block_n, block_k = 4, min(4096, max(32, 1 << (k - 1).bit_length()))
    split_k = 1
    while (_cdiv(n, block_n) * split_k < num_sms and k // (2 * split_k) >= 2 * block_k
           and split_k < 16):
        split_k *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k,
            "num_warps": max(1, min(4, block_k // 1024)), "num_stages": 1}


@functools.cache
def int4_a8_config(m: int, n: int, k: int, group: int, device: torch.device) -> dict:
    """The tuned configuration on `device` if there is one, else default_config (cached)."""
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 132)
    return get_config(KERNEL, config_key(row_bucket(m), n, k, group),
                      default_config(row_bucket(m), n, k, num_sms))


def round_to_int8_chunks(x: torch.Tensor) -> Int8Chunks:
    """x [M, K] (last dim contiguous) rounded by one launch: int8_chunks_ref's values."""
    m, k = x.shape
    kc = _cdiv(k, CHUNK)
    out = Int8Chunks.empty(m, k, x.dtype, x.device)
    pdl = use_pdl(x.device)
    kernels.quantize_x_words_kernel[(m, _cdiv(kc, _XQ))](
        x, out.words, out.floats, m, k, kc, x.stride(0), XQ=_XQ, INT8_MAX=INT8_MAX, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return out


def int4_gemv_a8(x: torch.Tensor | Int8Chunks, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """x [..., K] (1..MAX_ROWS rows, bf16/fp16/fp32) times group-wise INT4 weights (qweight
    uint8 [N, Kp / 2], scales float32 and zeros uint8 [N, Kp / group], Kp >= K a multiple of
    group, group a multiple of 32) -> [..., N] in x's dtype; x rounded to int8 per 32 columns
    first, or handed over rounded (Int8Chunks [M, K]: the result is [M, N])."""
    if triton is None:
        raise RuntimeError("int4_gemv_a8 needs triton; use int4_gemv_a8_ref")
    rounded = isinstance(x, Int8Chunks)
    n, k = qweight.shape[0], x.cols if rounded else x.shape[-1]
    num_groups = scales.shape[-1]
    if (qweight.dtype != torch.uint8 or scales.shape != (n, num_groups)
            or zeros.shape != (n, num_groups) or zeros.dtype != torch.uint8
            or qweight.shape[1] * 2 != num_groups * group or num_groups * group < k
            or group % CHUNK or qweight.shape[1] % 4 or qweight.stride(1) != 1):
        raise ValueError(f"int4_gemv_a8: qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} {zeros.dtype} are "
                         f"not an int4 group-{group} weight for K = {k} (groups of a multiple "
                         "of 32, integer zeros)")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"int4_gemv_a8: bias {tuple(bias.shape)} does not match {n} outputs")
    if scales.stride() != zeros.stride():  # one stride pair serves both
        scales, zeros = scales.contiguous(), zeros.contiguous()
    xr = x if rounded else round_to_int8_chunks(gemv_rows(x, k, "int4_gemv_a8"))
    m, dev = xr.words.shape[1], xr.words.device
    cfg = config if config is not None else int4_a8_config(m, n, k, group, dev)
    block_n, block_k, split_k = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    if block_k % CHUNK or block_k & (block_k - 1):
        raise ValueError(f"int4_gemv_a8 config {cfg}: BLOCK_K must be a power of two >= 32")
    num_tiles = _cdiv(n, block_n)
    split_k, partial, counters = split_k_plan(xr.floats, split_k, num_tiles, m, n,
                                               f"int4_gemv_a8 config {cfg}")
    k_iters = _cdiv(_cdiv(k, split_k), block_k)
    y = torch.empty(m, n, dtype=xr.dtype, device=dev)
    if partial is None:
        partial, counters = y, y
    interp = interpreted()
    pdl = use_pdl(dev)
    kernels.gemv_int4_a8_kernel[(num_tiles, split_k)](
        qweight.view(torch.int32), scales, zeros, bias if bias is not None else scales, y,
        partial, counters, xr.words, xr.floats, m, n, _cdiv(k, CHUNK), k_iters, split_k,
        qweight.stride(0) // 4, scales.stride(0), scales.stride(1), GROUP=group,
        HAS_BIAS=bias is not None, EVEN_K=k % (split_k * block_k) == 0, SPLIT=split_k > 1,
        BLOCK_M=row_bucket(m), BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["num_stages"],
        STATIC_ITERS=k_iters if interp else 0, PREFETCH=cfg.get("PREFETCH", False),
        ASM=inline_ptx(dev), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )
    return y if rounded else y.reshape(*x.shape[:-1], n)
