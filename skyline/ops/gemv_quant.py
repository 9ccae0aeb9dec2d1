"""Small-batch GEMV over quantized weights: y = x W^T (+ b) for 1..8 rows of x, W stored as
FP8 (e4m3, one scale per output row) or group-wise asymmetric INT8 / INT4 (ops/int_matmul.py's
layout). The same streaming scheme as `skyline/ops/gemv.py` (FMA or tensor-core DOT mode,
split-K with the last-arriver reduction and its per-device counters), with the weight tile
loaded in its stored width and converted in registers, so each weight byte is read once:

- FP8 (WEIGHT_KIND 0), W8A8 (`fp8_gemv_a8`): the tensor cores multiply fp8 tiles as loaded
  (nothing converted per weight), x either in bf16/fp16 quantized inside the kernel, one e4m3
  scale per row and BLOCK_K-column tile (finer than per row; no separate kernel, no extra
  launch; kernel name "gemv_fp8a8" in the tuning tables), or quantized per row beforehand
  (y = (x_q @ W_q^T) * x_scale * w_scale, the values `_scaled_mm` computes; "gemv_fp8a8q").
  The weights' per-row scale is applied once, at the end.
- INT8 / INT4 (WEIGHT_KIND 1 / 2): W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with
  g = k // GROUP. BLOCK_K divides GROUP, so every K tile of a row lies in one group: its scale
  and zero are two [BLOCK_N] loads per tile. INT4 bytes hold element 2j in the low nibble and
  2j + 1 in the high one.
  FMA mode (gemv_quant_triton.py's `gemv_int_fma_kernel`) reads the weights as int32 words
  (8 nibbles or 4 bytes: element PER * j + i is field i of word j) against contiguous,
  vector-loaded columns of x, and builds floats without int->float converts: the code
  shifted under the mantissa of a power of two MAGIC and OR-ed with its exponent is the float
  MAGIC + q, and
  (MAGIC + q) * scale - (MAGIC + zero) * scale is one FMA with a per-row constant per tile.
  In DOT mode INT8 tiles enter the tensor cores as the codes q (0..255, exact in bf16/fp16) and
  the tile's sum loses zero * sum(x over the tile), so zeros may be any float (GGUF's offsets,
  quant/gguf.py), not only integers. INT4 tiles enter as OFFSET + q, floats built from the
  nibbles by bit operations alone (a PTX prmt and lop3 per two weights on NVIDIA GPUs: OFFSET
  128 in bf16, 1024 in fp16, exact), against the even (low nibble) and odd (high nibble) columns
  of x; the tile's sum then loses (OFFSET + zero) * sum(x over the tile), and the group scale
  multiplies the [BLOCK_N, 16] result. Nothing is converted or subtracted per weight. X_LEFT (a
  config key) swaps the operands, x [16, BLOCK_K / 2] times the weight tile transposed: Triton
  then streams the packed tile through shared memory in 16-byte vectors into the MMA's
  right-hand registers, instead of 2-byte loads into its left-hand layout (fewer instructions
  per weight).

All masks are booleans (comparisons and their `&`), as Triton's interpreter from 3.9 requires.

Accumulation in fp32. No host syncs; CUDA-graph safe as gemv.py is. Launch configurations come
from the tuning tables (kernels "gemv_fp8", "gemv_int8", "gemv_int4") over `default_config`.
"""

from __future__ import annotations

import functools

import torch

from skyline.ops import gemv_quant_triton as kernels
from skyline.ops.gemv import MAX_ROWS, _cdiv, gemv_rows, row_bucket, split_k_plan
from skyline.ops.pdl import use_pdl
from skyline.ops.triton_utils import inline_ptx, interpreted, triton
from skyline.ops.tuning import get_config

FP8, INT8, INT4 = 0, 1, 2  # WEIGHT_KIND
KIND_NAMES = {FP8: "fp8", INT8: "int8", INT4: "int4"}
_ACT_DTYPES = (torch.bfloat16, torch.float16)
# INT4 in DOT mode: the PTX unpacking of gemv_quant_triton.py per activation dtype, and the
# offset its floats carry (OFFSET + q exact in that dtype; float32 x converts q itself).
_INT4_ASM = {torch.bfloat16: 1, torch.float16: 2}
_INT4_OFFSET = {torch.bfloat16: 128.0, torch.float16: 1024.0}


def quant_gemv_ok(x: torch.Tensor) -> bool:
    """Whether the quantized GEMV serves x: CUDA, bf16/fp16, 1..MAX_ROWS rows."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return (triton is not None and x.is_cuda and x.dtype in _ACT_DTYPES
            and 1 <= m <= MAX_ROWS)


def quantize_tiles_fp8_ref(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [M, K] rounded as fp8_gemv_a8 quantizes it in the kernel: e4m3 with one scale per row
    and block_k-column tile (amax / 448), returned dequantized in float32."""
    m, k = x.shape
    xt = torch.nn.functional.pad(x.float(), (0, -k % block_k)).view(m, -1, block_k)
    amax = xt.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    q = (xt * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)
    return q.view(m, -1)[:, :k]


def fp8_gemv_a8_ref(xq: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
                    w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.bfloat16,
                    block_k: int | None = None, x_scale_block: int = 0) -> torch.Tensor:
    """e4m3 xq [M, K] with float32 x_scale [M] (or [M, 1]; with x_scale_block, [M, G]: one
    per row and x_scale_block columns), e4m3 weight [N, K], w_scale [N] -> [M, N] in
    out_dtype. With x_scale None, xq is bf16/fp16/fp32, quantized per row and block_k-column
    tile as the kernel does."""
    if x_scale is None:
        assert block_k is not None, "in-kernel quantization rounds per block_k tile"
        xd = quantize_tiles_fp8_ref(xq, block_k)
    elif x_scale_block:
        k = xq.shape[-1]
        xd = xq.float() * x_scale.float().repeat_interleave(x_scale_block, dim=-1)[:, :k]
    else:
        xd = xq.float() * x_scale.float().reshape(-1, 1)
    y = (xd @ weight.float().t()) * w_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int_gemv_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, bits: int, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize (ops/int_matmul.py layout) then multiply in fp32 -> [..., N] in x's dtype."""
    from skyline.ops.int_matmul import dequantize_int_ref

    k = x.shape[-1]
    w = dequantize_int_ref(qweight, scales, zeros, bits, group)[:, :k]
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _pow2_divisor(group: int, cap: int) -> int:
    """The largest power of two <= cap dividing group."""
    b = 1
    while b * 2 <= cap and group % (b * 2) == 0:
        b *= 2
    return b


def config_key(m: int, n: int, k: int, group: int = 0) -> str:
    """Tuning-table key: as gemv's, plus the group size for integer weights."""
    return f"{n}x{k}:m{row_bucket(m)}" + (f":g{group}" if group else "")


def default_config(kind: int, m: int, n: int, k: int, group: int = 0,
                   num_sms: int = 132, a8: bool = False) -> dict:
    """A launch configuration for shapes without a tuned entry.

    FMA for one or two rows, tensor cores above. Tiles of about 2 KiB of weight bytes per
    program and iteration (16 bytes per thread with 4 warps); for integer weights BLOCK_K is the
    largest power of two up to 128 (FP8: 512 / 256) dividing the group. Split K until about four
    programs per SM, keeping at least four K tiles per split. X_BCAST (integer weights, FMA
    mode): x loaded once per tile and broadcast over W's rows, from two rows of x on.
    """
    use_dot = m > 2 or a8  # fp8 x fp8 (a8): always the tensor cores
    if kind == FP8:
        block_k = 256 if use_dot else 512
        block_n = 64 if use_dot else (16 if m == 1 else 8)
    else:
        block_k = _pow2_divisor(group, 128)
        row_bytes = block_k // 2 if kind == INT4 else block_k
        block_n = 64 if use_dot else max(8, min(128, 2048 // row_bytes // row_bucket(m)))
    split_k = 1
    while (_cdiv(n, block_n) * split_k < 4 * num_sms
           and k // (2 * split_k) >= 4 * block_k and split_k < 16):
        split_k *= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "USE_DOT": use_dot,
            "num_warps": 4, "num_stages": 3 if use_dot else 1,
            "X_BCAST": kind != FP8 and not use_dot and m >= 2}


def kernel_name(kind: int, a8: bool = False, prequant: bool = False) -> str:
    """The tuning-table kernel name of a weight kind (W8A8 fp8: "gemv_fp8a8", with x
    quantized beforehand "gemv_fp8a8q")."""
    if a8:
        return "gemv_fp8a8q" if prequant else "gemv_fp8a8"
    return f"gemv_{KIND_NAMES[kind]}"


@functools.cache
def quant_gemv_config(kind: int, m: int, n: int, k: int, group: int,
                      device: torch.device, a8: bool = False, prequant: bool = False
                      ) -> dict:
    """The tuned configuration on `device` if there is one, else default_config (cached)."""
    num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 132)
    m = row_bucket(m)
    return get_config(kernel_name(kind, a8, prequant), config_key(m, n, k, group),
                      default_config(kind, m, n, k, group, num_sms, a8))


def fp8_gemv_a8(xq: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor,
                w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16,
                config: dict | None = None, x_scale_block: int = 0) -> torch.Tensor:
    """W8A8 with e4m3 weight [N, K] and float32 w_scale [N], bias [N] -> [..., N] in out_dtype
    (bf16/fp16). xq [..., K] (1..MAX_ROWS rows): e4m3 with float32 x_scale (one per row; with
    x_scale_block, a power of two >= 128, [rows, cdiv(K, x_scale_block)]: one per row and
    block), or (x_scale None) bf16/fp16 activations that the kernel quantizes tile by tile."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv_a8: weight must be float8_e4m3fn [N, K], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if (xq.dtype == torch.float8_e4m3fn) != (x_scale is not None) or (
            x_scale is None and xq.dtype not in _ACT_DTYPES):
        raise ValueError(f"fp8_gemv_a8: x must be float8_e4m3fn with its scales, or bf16/fp16 "
                         f"without; got {xq.dtype} and {'no ' if x_scale is None else ''}scales")
    n, k = weight.shape
    groups = _cdiv(k, x_scale_block) if x_scale_block else 1
    if w_scale.numel() != n or (x_scale is not None
                                and x_scale.numel() != xq.numel() // max(k, 1) * groups):
        raise ValueError(f"fp8_gemv_a8: {w_scale.numel()} weight scales for {n} rows, x "
                         f"scales for {xq.numel() // max(k, 1)} rows of {groups} blocks")
    if x_scale_block and (x_scale_block < 128 or x_scale_block & (x_scale_block - 1)):
        raise ValueError(f"fp8_gemv_a8: x_scale_block {x_scale_block} is not a power of two "
                         f">= 128")
    if xq.shape[-1] != k or out_dtype not in _ACT_DTYPES:
        raise ValueError(f"fp8_gemv_a8: x {tuple(xq.shape)} against weight {(n, k)}, "
                         f"out_dtype {out_dtype}")
    xs = x_scale.reshape(-1).float().contiguous() if x_scale is not None else None
    return _launch(FP8, xq, weight.contiguous(), w_scale.reshape(-1).contiguous(), None, n, k,
                   0, bias, config, xs, out_dtype, a8=True, xs_block=x_scale_block)


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             bits: int, group: int, bias: torch.Tensor | None = None,
             config: dict | None = None) -> torch.Tensor:
    """x [..., K] (1..MAX_ROWS rows) times group-wise INT8/INT4 weights in ops/int_matmul.py's
    layout (qweight uint8 [N, Kp * bits / 8], scales float32 / zeros uint8 or float32
    [N, Kp / group], Kp >= K a multiple of group) -> [..., N] in x's dtype."""
    if bits not in (4, 8):
        raise ValueError(f"int_gemv: bits must be 4 or 8, got {bits}")
    n, k = qweight.shape[0], x.shape[-1]
    num_groups = scales.shape[-1]
    if (qweight.dtype != torch.uint8 or scales.shape != (n, num_groups)
            or zeros.shape != (n, num_groups)
            or qweight.shape[1] * 8 != num_groups * group * bits or num_groups * group < k):
        raise ValueError(f"int_gemv: qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} are not an "
                         f"int{bits} group-{group} weight for K = {k}")
    kind = INT4 if bits == 4 else INT8
    return _launch(kind, x, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), n, k,
                   group, bias, config)


def _launch(kind: int, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, n: int, k: int, group: int,
            bias: torch.Tensor | None, config: dict | None,
            x_scale: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None, a8: bool = False,
            xs_block: int = 0) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the quantized GEMV needs triton; use the *_ref functions")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"quantized gemv: bias {tuple(bias.shape)} does not match {n} outputs")
    x2 = gemv_rows(x, k, "quantized gemv")
    m = x2.shape[0]
    cfg = config if config is not None else quant_gemv_config(
        kind, m, n, k, group, x.device, a8, x_scale is not None)
    if config is None and xs_block and cfg["BLOCK_K"] > xs_block:
        cfg = {**cfg, "BLOCK_K": xs_block}  # a K tile may not span two x scales
    block_n, block_k, split_k = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    use_dot = bool(cfg["USE_DOT"])
    if a8 and (not use_dot or block_k < 32 or xs_block % block_k):
        raise ValueError(f"fp8 x fp8 gemv config {cfg}: needs USE_DOT and BLOCK_K >= 32 "
                         f"dividing the x scales' block {xs_block}")
    if kind != FP8 and group % block_k:
        raise ValueError(f"quantized gemv config {cfg}: BLOCK_K must divide the group {group}")
    per_word = 8 if kind == INT4 else 4  # FMA mode reads integer weights as int32 words
    if kind != FP8 and not use_dot and (block_k % per_word or w.shape[1] % 4
                                        or w.data_ptr() % 4):
        raise ValueError(f"quantized gemv config {cfg}: FMA mode needs BLOCK_K a multiple of "
                         f"{per_word} and 4-byte aligned weight rows, got {tuple(w.shape)}")
    if cfg.get("X_LEFT") and (kind != INT4 or not use_dot):
        raise ValueError(f"quantized gemv config {cfg}: X_LEFT is an INT4 tensor-core mode")
    min_k = 32 if kind == INT4 else 16  # INT4 dots take BLOCK_K / 2 columns
    if use_dot and (block_n < 16 or block_k < min_k):
        raise ValueError(f"quantized gemv config {cfg}: USE_DOT needs BLOCK_N >= 16 and "
                         f"BLOCK_K >= {min_k}")
    num_tiles = _cdiv(n, block_n)
    split_k, partial, counters = split_k_plan(x, split_k, num_tiles, m, n,
                                               f"quantized gemv config {cfg}")
    block_m = 16 if use_dot else row_bucket(m)
    k_iters = _cdiv(_cdiv(k, split_k), block_k)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if partial is None:
        partial, counters = y, y
    interp = interpreted()
    pdl = use_pdl(x.device)
    if kind != FP8 and not use_dot:
        kernels.gemv_int_fma_kernel[(num_tiles, split_k)](
            x2, w.view(torch.int32), scales, zeros, bias if bias is not None else scales, y,
            partial, counters, m, n, k, k_iters, split_k, x2.stride(0), w.stride(0) // 4,
            scales.stride(0), BITS=4 if kind == INT4 else 8, GROUP=group,
            HAS_BIAS=bias is not None, EVEN_K=k % (split_k * block_k) == 0, SPLIT=split_k > 1,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=cfg["num_stages"],
            STATIC_ITERS=k_iters if interp else 0, X_BCAST=bool(cfg.get("X_BCAST", False)),
            PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
        )
        return y.reshape(*x.shape[:-1], n)
    kernels.gemv_quant_kernel[(num_tiles, split_k)](
        x2, w, scales, zeros if zeros is not None else scales,
        bias if bias is not None else scales, y, partial, counters,
        x_scale if x_scale is not None else scales,
        m, n, k, k_iters, split_k, x2.stride(0), w.stride(0), scales.stride(0) if kind else 0,
        WEIGHT_KIND=kind, GROUP=max(group, 1), HAS_BIAS=bias is not None,
        EVEN_K=k % (split_k * block_k) == 0, SPLIT=split_k > 1, USE_DOT=use_dot,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_STAGES=cfg["num_stages"], STATIC_ITERS=k_iters if interp else 0,
        X_QUANT=0 if not a8 else (1 if x_scale is not None else 2), ROUND_E4M3=interp,
        XS_BLOCK=xs_block, XS_STRIDE=_cdiv(k, xs_block) if xs_block else 1,
        INT4_ASM=_INT4_ASM.get(x.dtype, 0) if inline_ptx(x.device) else 0,
        INT4_OFFSET=_INT4_OFFSET.get(x.dtype, 0.0), X_LEFT=bool(cfg.get("X_LEFT", False)),
        PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )
    return y.reshape(*x.shape[:-1], n)
