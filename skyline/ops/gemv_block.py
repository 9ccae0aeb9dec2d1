"""Block-scaled weights read at their own bits on CUDA: NVFP4 (4.5 bits a weight: E2M1 codes,
an E4M3 scale per 16, a float32 scale per tensor), MXFP4 (4.25 bits: E2M1 codes, an E8M0 scale
per 32) and GGUF Q6_K (6.56 bits: 210 bytes per 256) and Q5_K (5.5 bits: 176 bytes per 256), as
stored.

- `block_gemv`: y = x W^T (+ b) for 1..MAX_BLOCK_ROWS rows of x (decode batches), the stored
  bytes decoded in registers, in one of two modes (config "A8"): integer (the default up to
  four rows, Q6_K two, at most 8: x rounded to int8 per 32 columns as llama.cpp's q8_1, each
  word of codes against x's by `dp4a`, gemv_block_a8_triton.py) or tensor cores (above, tiles
  of 16-64 rows of x: the weight tile decoded once for all of them, rounded to x's dtype,
  exact for NVFP4 and MXFP4, whose e2m1 * e4m3 / e8m0 products have at most 6 significant
  bits; GGUF tiles add their rounding error as a second bf16/fp16 operand, weights to ~16
  bits; gemv_block_triton.py). Split-K with gemv.py's last-arriver reduction. No host syncs:
  CUDA-graph safe. The layers call it through block_linear.py, which takes larger batches to
  a dequantizer and a matmul.

The references (`*_ref`) dequantize with ops/fp4.py and ops/dequant.py, then multiply in
float32 (with `a8`, x rounded first as the integer mode rounds it). Launch configurations come
from the tuning tables (kernels "gemv_nvfp4", "gemv_q6_k", "gemv_q5_k", "gemv_mxfp4") over
`default_config`.
"""

from __future__ import annotations

import functools

import torch

from skyline.ops import gemv_block_a8_triton as a8_kernels
from skyline.ops import gemv_block_triton as kernels
from skyline.ops.dequant import dequantize_ref
from skyline.ops.fp4 import dequantize_mxfp4, dequantize_nvfp4
from skyline.ops.gemv import MAX_ROWS, _cdiv, gemv_rows, row_bucket, split_k_plan
from skyline.ops.gemv_int_a8 import CHUNK, INT8_MAX, quantize_chunks_int8_ref
from skyline.ops.pdl import use_pdl
from skyline.ops.triton_utils import inline_ptx, interpreted, triton
from skyline.ops.tuning import get_config

NVFP4, Q6_K, Q5_K, MXFP4 = 0, 1, 2, 3  # FORMAT
FORMAT_NAMES = {NVFP4: "nvfp4", Q6_K: "q6_k", Q5_K: "q5_k", MXFP4: "mxfp4"}
FP4_FORMATS = (NVFP4, MXFP4)
KERNELS = {fmt: f"gemv_{name}" for fmt, name in FORMAT_NAMES.items()}  # tuning tables' names
GGUF_FORMATS = {14: Q6_K, 13: Q5_K}  # ggml type id -> FORMAT
_BLOCK_BYTES = {Q6_K: 210, Q5_K: 176}  # bytes per super-block of 256
SUPER = 256
_ACT_DTYPES = (torch.bfloat16, torch.float16)
# The GEMV takes up to MAX_BLOCK_ROWS rows (the tensor-core mode above MAX_ROWS: tiles of up
# to 64 rows of x reading the stored bits once; the integer mode up to MAX_ROWS); the layers
# send it fewer (block_linear.LINEAR_ROWS).
MAX_BLOCK_ROWS = 64


def block_gemv_ok(x: torch.Tensor, max_rows: int = MAX_BLOCK_ROWS) -> bool:
    """Whether block_gemv serves x: CUDA, bf16/fp16, 1..max_rows rows."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return (triton is not None and x.is_cuda and x.dtype in _ACT_DTYPES
            and 1 <= m <= min(max_rows, MAX_BLOCK_ROWS))


def nvfp4_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   tensor_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   a8: bool = False) -> torch.Tensor:
    """x [..., K] times NVFP4 weights (ops/fp4.dequantize_nvfp4's layout, tensor_scale [N])
    -> [..., N] in x's dtype, float32 products; with a8, x rounded as the integer mode does."""
    w = dequantize_nvfp4(qweight, scales, tensor_scale)[:, : x.shape[-1]]
    return _linear_ref(x, w, bias, a8)


def mxfp4_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None = None, a8: bool = False) -> torch.Tensor:
    """x [..., K] times MXFP4 weights (ops/fp4.dequantize_mxfp4's layout) -> [..., N] in x's
    dtype, float32 products; with a8, x rounded as the integer mode does."""
    w = dequantize_mxfp4(qweight, scales)[:, : x.shape[-1]]
    return _linear_ref(x, w, bias, a8)


def gguf_gemv_ref(x: torch.Tensor, data: torch.Tensor, qtype: int,
                  bias: torch.Tensor | None = None, a8: bool = False) -> torch.Tensor:
    """x [..., K] times a GGUF tensor's raw blocks [N, bytes_per_row] -> [..., N] in x's
    dtype, float32 products; with a8, x rounded as the integer mode does."""
    return _linear_ref(x, dequantize_ref(data, qtype), bias, a8)


def rounded_x_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the integer mode sees it, float32: int8 codes per 32 columns times their
    chunk's scale (gemv_int_a8.quantize_chunks_int8_ref)."""
    k = x.shape[-1]
    q, sx = quantize_chunks_int8_ref(x.reshape(-1, k))
    xr = q.float() * sx.repeat_interleave(CHUNK, dim=1)[:, :k]
    return xr.reshape(x.shape)


def _linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                a8: bool = False) -> torch.Tensor:
    y = (rounded_x_ref(x) if a8 else x.float()) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def default_config(fmt: int, m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """A launch configuration for shapes without a tuned entry: the integer mode up to four
    rows (Q6_K: two, its 16-bit loads repeat per row of x), tensor cores above (tiles of 256
    columns: GGUF's one super-block); K split while there are few programs per SM, keeping at
    least two K tiles per split (tensor cores: four)."""
    a8 = m <= (2 if fmt == Q6_K else 4)
    if a8:
        # one-warp programs of 4 rows and two super-blocks a tile, K split until about 16
        # programs per SM, at least two tiles each (bench/kernels/gemv_fp4_gguf_speed.py
        # --sweep)
        block_n, block_k, warps, per_sm, tiles = 4, 2 * SUPER, 1, 16, 2
    else:
        block_n, block_k, warps, per_sm, tiles = 32, SUPER, 4, 4, 4
    split_k = 1
    while (_cdiv(n, block_n) * split_k < per_sm * num_sms
           and k // (2 * split_k) >= tiles * block_k and split_k < 16):
        split_k *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "A8": a8,
            "num_warps": warps, "num_stages": 1 if a8 else 2}


@functools.cache
def block_gemv_config(fmt: int, m: int, n: int, k: int, device: torch.device) -> dict:
    """The tuned configuration on `device` if there is one, else default_config (cached)."""
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 132)
    return get_config(KERNELS[fmt], config_key(m, n, k),
                      default_config(fmt, row_bucket(m), n, k, num_sms))


def config_key(m: int, n: int, k: int) -> str:
    """The tuning tables' key of an [m, k] x [n, k]^T product (m by its row bucket)."""
    return f"{n}x{k}:m{row_bucket(m)}"


def nvfp4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               tensor_scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """x [..., K] (1..MAX_BLOCK_ROWS rows) times NVFP4 weights: codes uint8 [N, Kp / 2], E4M3 scales
    [N, Kp / 16], float32 tensor_scale [N] (Kp >= K a multiple of 16) -> [..., N] in x's
    dtype."""
    n, k = qweight.shape[0], x.shape[-1]
    if (qweight.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn
            or scales.shape != (n, qweight.shape[1] // 8) or qweight.shape[1] % 8
            or qweight.shape[1] * 2 < k or tensor_scale.numel() != n):
        raise ValueError(f"nvfp4_gemv: qweight {qweight.dtype} {tuple(qweight.shape)}, scales "
                         f"{scales.dtype} {tuple(scales.shape)}, tensor_scale "
                         f"{tuple(tensor_scale.shape)} are not NVFP4 weights for K = {k}")
    return _launch(NVFP4, x, qweight.contiguous(), scales.contiguous(),
                   tensor_scale.reshape(-1).float().contiguous(), n, k, bias, config)


def mxfp4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (1..MAX_BLOCK_ROWS rows) times MXFP4 weights: codes uint8 [N, Kp / 2], E8M0 scales
    uint8 [N, Kp / 32] (Kp >= K a multiple of 32) -> [..., N] in x's dtype."""
    n, k = qweight.shape[0], x.shape[-1]
    check_mxfp4(qweight, scales, k, "mxfp4_gemv")
    scales = scales.contiguous()
    return _launch(MXFP4, x, qweight.contiguous(), scales, scales, n, k, bias, config)


def check_mxfp4(qweight: torch.Tensor, scales: torch.Tensor, k: int, what: str) -> None:
    n = qweight.shape[0]
    if (qweight.dtype != torch.uint8 or scales.dtype != torch.uint8
            or scales.shape != (n, qweight.shape[1] // 16) or qweight.shape[1] % 16
            or qweight.shape[1] * 2 < k):
        raise ValueError(f"{what}: qweight {qweight.dtype} {tuple(qweight.shape)}, scales "
                         f"{scales.dtype} {tuple(scales.shape)} are not MXFP4 weights for "
                         f"K = {k}")


def gguf_gemv(x: torch.Tensor, data: torch.Tensor, qtype: int,
              bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [..., K] (1..MAX_BLOCK_ROWS rows) times a Q6_K / Q5_K tensor's raw blocks uint8
    [N, K / 256 * block_bytes] -> [..., N] in x's dtype."""
    fmt = gguf_format(data, qtype, x.shape[-1])
    data = data.contiguous()
    return _launch(fmt, x, data, data, data, data.shape[0], x.shape[-1], bias, config)


def gguf_format(data: torch.Tensor, qtype: int, k: int) -> int:
    fmt = GGUF_FORMATS.get(int(qtype))
    if fmt is None:
        raise ValueError(f"gguf_gemv: ggml type {int(qtype)} is not Q6_K or Q5_K")
    if (data.dtype != torch.uint8 or data.dim() != 2 or k % SUPER
            or data.shape[1] != k // SUPER * _BLOCK_BYTES[fmt]):
        raise ValueError(f"gguf_gemv: {data.dtype} {tuple(data.shape)} are not "
                         f"{FORMAT_NAMES[fmt].upper()} blocks of {k} columns")
    return fmt


def _launch(fmt: int, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
            tensor_scale: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
            config: dict | None) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the block GEMV needs triton; use the *_ref functions")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"block gemv: bias {tuple(bias.shape)} does not match {n} outputs")
    x2 = gemv_rows(x, k, "block gemv", MAX_BLOCK_ROWS)
    m = x2.shape[0]
    cfg = config if config is not None else block_gemv_config(fmt, m, n, k, x.device)
    block_n, block_k, split_k = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    a8 = bool(cfg["A8"])
    _check_tile(fmt, block_n, block_k, a8, cfg)
    if a8 and m > MAX_ROWS:
        raise ValueError(f"block gemv config {cfg}: the integer mode takes 1..{MAX_ROWS} rows, "
                         f"got {m}")
    num_tiles = _cdiv(n, block_n)
    split_k, partial, counters = split_k_plan(x, split_k, num_tiles, m, n,
                                               f"block gemv config {cfg}")
    if a8:
        y = _launch_a8(fmt, x2, w, scales, tensor_scale, n, k, bias, cfg, num_tiles, split_k,
                       partial, counters)
        return y.reshape(*x.shape[:-1], n)
    k_iters = _cdiv(_cdiv(k, split_k), block_k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if partial is None:
        partial, counters = y, y
    kernels.gemv_block_kernel[(num_tiles, split_k)](
        x2, w, w if fmt in FP4_FORMATS else w.view(torch.float16), scales, tensor_scale,
        bias if bias is not None else tensor_scale, y, partial, counters,
        m, n, k, k_iters, split_k, x2.stride(0), w.stride(0), scales.stride(0),
        FORMAT=fmt, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        W_LO=fmt not in FP4_FORMATS,
        IEEE=x.dtype == torch.float32, BLOCK_M=max(16, row_bucket(m)), BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=cfg["num_stages"],
        STATIC_ITERS=k_iters if interpreted() else 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y.reshape(*x.shape[:-1], n)


def round_x_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (int32 words [M, 8 KC] of four consecutive int8
    codes, float32 [M, KC, 2]: each chunk of 32 columns' scale and scale times its sum of
    codes), KC = cdiv(K, 32), columns past K 0: quantize_chunks_int8_ref's values, one launch."""
    m, k = x.shape
    kc = _cdiv(k, CHUNK)
    xq = torch.empty(m, kc * 8, dtype=torch.int32, device=x.device)
    xf = torch.empty(m, kc, 2, dtype=torch.float32, device=x.device)
    xq_chunks = 16
    pdl = use_pdl(x.device)
    a8_kernels.quantize_x_q8_kernel[(m, _cdiv(kc, xq_chunks))](
        x, xq, xf, m, k, kc, x.stride(0), XQ=xq_chunks, INT8_MAX=INT8_MAX, PDL=pdl,
        num_warps=4, launch_pdl=pdl)
    return xq, xf


def _launch_a8(fmt: int, x2: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
               tensor_scale: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
               cfg: dict, num_tiles: int, split_k: int, partial: torch.Tensor | None,
               counters: torch.Tensor | None) -> torch.Tensor:
    m, dev = x2.shape[0], x2.device
    xq, xf = round_x_q8(x2)
    # FP4 formats read their codes to the stored width Kp; GGUF tiles are super-blocks of K
    kp = w.shape[1] * 2 if fmt in FP4_FORMATS else k
    k_iters = _cdiv(_cdiv(kp, split_k), cfg["BLOCK_K"])
    y = torch.empty(m, n, dtype=x2.dtype, device=dev)
    if partial is None:
        partial, counters = y, y
    interp = interpreted()
    pdl = use_pdl(dev)
    w32 = w.view(torch.int32) if fmt != Q6_K else w  # Q6_K rows need not be whole words
    kc = _cdiv(k, CHUNK)
    a8_kernels.gemv_block_a8_kernel[(num_tiles, split_k)](
        xq.view(torch.int64) if fmt in FP4_FORMATS else xq, xf, w, w.view(torch.int16), w32, scales,
        tensor_scale, bias if bias is not None else xf, y, partial, counters,
        m, n, kp, kc, k_iters, split_k, w.stride(0), scales.stride(0),
        FORMAT=fmt, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        EVEN_K=kp % (split_k * cfg["BLOCK_K"]) == 0 and kp <= kc * CHUNK, BLOCK_M=row_bucket(m),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["num_stages"],
        STATIC_ITERS=k_iters if interp else 0,
        ASM=inline_ptx(dev), PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )
    return y


def _check_tile(fmt: int, block_n: int, block_k: int, a8: bool, cfg: dict) -> None:
    if fmt not in FP4_FORMATS and (block_k != SUPER if not a8 else block_k % SUPER
                                   or block_k & (block_k - 1)):
        raise ValueError(f"block gemv config {cfg}: GGUF tiles are one super-block, "
                         f"BLOCK_K {SUPER} (A8: a power of two of them)")
    group = 32 if fmt == MXFP4 else 16
    if fmt in FP4_FORMATS and (block_k < group or block_k & (block_k - 1)):
        raise ValueError(f"block gemv config {cfg}: {FORMAT_NAMES[fmt].upper()} needs BLOCK_K "
                         f"a power of two >= {group}")
    if not a8 and block_n < 16:
        raise ValueError(f"block gemv config {cfg}: the tensor-core mode needs BLOCK_N >= 16")
    if a8 and block_k < CHUNK:
        raise ValueError(f"block gemv config {cfg}: A8 needs BLOCK_K >= {CHUNK}")
