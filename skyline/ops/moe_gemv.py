"""The MoE MLP at decode sizes (1..MAX_TOKENS tokens; MXFP4 experts with 16-bit activations
1..A8_MAX_TOKENS): two GEMV-style Triton launches over the (token, expert) pairs, no sorting,
no host sync (CUDA graphs capture it). Its reference is
ops/moe.py's `fused_moe_ref` (the same contract: x [T, K], stacked expert weights in any of the
three formats, routing weights and ids, activation, expert_map).

At a few tokens the MoE reads each routed expert's weights and does ~2 FLOPs per weight element
per row: it is bound by bytes, as a dense GEMV is. The grouped GEMM (ops/moe_triton.py) pays
there for its generality: a sort of the pairs into expert blocks (about ten small kernels), 16
rows of tensor-core tiles for one real row, and a separate activation and top-k sum. Here:

1. `up`: one program per (pair p, BLOCK_N columns of the intermediate size I): the rows n of
   the gate and n + I of the up projection of the pair's expert, streamed in
   [BLOCK_N, BLOCK_K] tiles against the token's row of x (FMA into fp32, reduced over K at the
   end, as gemv.py's FMA mode), dequantized in registers, then bias and the activation (SiLU and
   mul, or gpt-oss's clamped swiglu) fused: h [P, I] in x's dtype.
2. `down`: one program per (token t, BLOCK_N output columns): its k pairs' down rows one
   after the other, each times the pair's routing weight (bias included, as the reference
   weights the whole expert output), summed in fp32 in registers: the top-k sum needs neither
   a [P, H] buffer nor another launch.

Pairs are not grouped by expert, so two tokens routed to one expert read it twice (from L2 when
they run close in time). With 8 tokens of top-8 over 128 experts (Qwen3-30B-A3B) the 64 pairs
hit ~50 distinct experts (1.3x their bytes); with top-4 over 32 (gpt-oss) the 32 pairs hit ~20
(1.6x). The FMAs stay on CUDA cores without becoming the bound: at 8 tokens of Qwen3-30B-A3B
the 64 pairs x 4.7 M weights x 2 FLOPs are 0.6 GFLOP, ~10 us at an H200's ~60 fp32 TFLOP/s,
against ~110 us to read the ~50 experts' 470 MB. Beyond MAX_TOKENS the redundant reads grow
(at 16 tokens ~1.6x for Qwen3, ~2.3x for gpt-oss) past what the grouped GEMM's overheads cost, and
fused_moe takes the grouped path; MXFP4's integer mode keeps the GEMVs to A8_MAX_TOKENS, where
the grouped GEMM's MXFP4 tile (decoded through shared memory) loses to them even reading each
expert ~3x. Pairs whose expert another rank holds (expert_map -1) load nothing and add nothing.

Formats (ops/moe.py's ExpertWeights): dense; fp8 e4m3 with a scale per output channel (applied
once at the end) or per SCALE_BN x SCALE_BK block (BLOCK_K divides SCALE_BK: one scale per row
and tile); MXFP4 (bytes hold elements 2j, low nibble, and 2j + 1; E8M0 scale per 32), whose
tiles are [BLOCK_N, BLOCK_K / 32, 16] bytes (one scale per row and group of 16 bytes) against
x's even and odd columns.

Integer mode (config "A8"; the default for MXFP4 experts and bf16/fp16 activations): x, and
h before `down`, are rounded to int8 per 32 columns (gemv_block.round_x_q8, as llama.cpp's q8_1)
and each scale group of 32 columns (four words of eight E2M1 codes) meets them by `dp4a`,
through the dense block GEMV's tile function (gemv_block_a8_triton._fp4_a8): no float decode
of the weights, float32 only per scale group. Tiles are a few rows of one or two warps, as the
dense integer GEMV's. Unlike the dense GEMV, a program meets one row of activations whatever
the token count (`up` one pair's, `down` one token's), so the mode pays no more per weight at 8
tokens than at one.

Launch configurations: the tuning tables (kernels "moe_gemv_up", "moe_gemv_down", keyed by
shape, format, dtype and the token count) over `default_config`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from skyline.ops import moe_gemv_triton as kernels
from skyline.ops.activation import SWIGLU_ALPHA
from skyline.ops.gemv_block import round_x_q8
from skyline.ops.moe import ExpertWeights
from skyline.ops.triton_utils import inline_ptx, triton
from skyline.ops.tuning import dtype_name, get_config

MAX_TOKENS = 8  # fused_moe runs this path for 1..MAX_TOKENS tokens on CUDA
A8_MAX_TOKENS = 32  # ... and MXFP4 experts with bf16/fp16 activations (the integer mode)
_A8_DTYPES = (torch.bfloat16, torch.float16)
KERNELS = ("moe_gemv_up", "moe_gemv_down")  # names in the tuning tables
FMTS = {"dense": 0, "fp8": 1, "mxfp4": 2}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def max_tokens(w13: ExpertWeights, dtype: torch.dtype) -> int:
    """The most tokens this path takes: A8_MAX_TOKENS for MXFP4 experts with 16-bit
    activations, else MAX_TOKENS."""
    return A8_MAX_TOKENS if w13.fmt == "mxfp4" and dtype in _A8_DTYPES else MAX_TOKENS


def gemv_ok(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights) -> bool:
    """Whether the decode path serves x: CUDA (or the interpreter's CPU), 1..max_tokens rows of
    a float dtype, weights whose K tiles it can walk (unit stride along K)."""
    blk = w13.block()
    return (triton is not None and x.dtype in _DTYPES
            and 1 <= x.shape[0] <= max_tokens(w13, x.dtype)
            and w13.weight.stride(-1) == 1 and w2.weight.stride(-1) == 1
            and (w13.fmt != "mxfp4" or w13.k % 32 == 0)
            # fp8 blocks: the up rows (from row I) start a block row
            and (blk is None or (w13.n // 2) % blk[0] == 0))


def _block_k(k: int, w: ExpertWeights, want: int) -> int:
    """The K tile: `want`, at most K rounded up to a power of two (>= 32: MXFP4 scale groups)
    and inside one fp8 scale block. A K it does not divide ends in a masked tile (masked
    lanes fetch nothing), which costs less than the extra iterations of a smaller tile."""
    bk = min(want, max(32, 1 << (k - 1).bit_length()))
    blk = w.block()
    if blk is not None:
        bk = min(bk, blk[1] & -blk[1])
        if bk < 16:
            raise ValueError(f"fp8 scale blocks of {blk[1]} columns are too narrow for the MoE "
                             "kernel; use blocks of 16 columns or more")
    return bk


def default_config(kernel: str, num_tokens: int, k: int, fmt: str,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Without a tuned entry. MXFP4 experts with bf16/fp16 activations: the integer mode,
    two-warp programs of 2 rows and 1,024 columns a tile (what the tuner chose for both kernels
    at 1, 2 and 4 tokens of gpt-oss-20b on an H200). Otherwise tiles of 512 bytes of each
    weight row per K step in every format (bf16: 256 columns; fp8, MXFP4: 512); K loops of up
    to 16 tiles are unrolled (not MXFP4's, which spill unrolled), so a program issues its
    tiles' loads back to back (its only way to keep several in flight: at one token there are
    few programs per SM). `up` at one token: each of the k pairs x (I / 16) programs
    reads 2 x 16 rows (Qwen3-30B-A3B: 8 x 48 = 384 programs of 128 KB); `down` loops over the
    token's k experts, so its tiles are narrower (8 rows: 256 programs at H = 2048)."""
    if fmt == "mxfp4" and dtype in _A8_DTYPES:
        return {"A8": True, "BLOCK_N": 2, "BLOCK_K": 1024, "UNROLL": False, "num_warps": 2,
                "num_stages": 1}
    block_k = 256 if fmt == "dense" else 512
    # MXFP4's 3-D tiles (x spread over each) unrolled spill: 8 KB a thread for gpt-oss's up
    # (ptxas for sm_90); rolled, 226 registers and none spilled
    unroll = fmt != "mxfp4" and -(-k // block_k) <= 16
    return {"A8": False, "BLOCK_N": 16 if kernel == "moe_gemv_up" else 8, "BLOCK_K": block_k,
            "UNROLL": unroll, "num_warps": 4, "num_stages": 1}


@functools.cache
def _config(kernel: str, n: int, k: int, fmt: str, dtype: torch.dtype, t: int
            ) -> dict[str, Any]:
    """The table's entry for `t` tokens, else for the nearest fewer tokens tuned (a program's
    work, one pair's or one token's rows, is the same at any token count: only the number of
    programs grows) in the default's mode (entries without "A8" are of the float mode), else
    the default."""
    default = default_config(kernel, t, k, fmt, dtype)
    for tt in (t >> i for i in range(t.bit_length())):
        found = get_config(kernel, f"n{n}:k{k}:{fmt}:{dtype_name(dtype)}:t{tt}", {})
        if found and bool(found.get("A8", False)) == default["A8"]:
            return {**default, **found}
    return default


def moe_gemv_config(kernel: str, num_tokens: int, w: ExpertWeights, dtype: torch.dtype
                    ) -> dict[str, Any]:
    """The launch configuration of `kernel` for `num_tokens` tokens (bucketed to powers of
    two)."""
    t = 1 << max(0, num_tokens - 1).bit_length()
    return _config(kernel, w.n, w.k, w.fmt, dtype, t)


def _a8(cfg: dict[str, Any], w: ExpertWeights, dtype: torch.dtype) -> bool:
    """Whether a launch takes the integer mode: asked for, MXFP4 with scales contiguous along K,
    16-bit activations."""
    if not cfg.get("A8", False):
        return False
    if w.fmt != "mxfp4" or dtype not in _A8_DTYPES:
        raise ValueError(f"MoE GEMV config {cfg}: the integer mode (A8) takes MXFP4 experts "
                         f"and bf16/fp16 activations, not {w.fmt} and {dtype}")
    if cfg["BLOCK_K"] < 32 or cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1):
        raise ValueError(f"MoE GEMV config {cfg}: A8 needs BLOCK_K a power of two >= 32")
    return w.scale.stride(-1) == 1


def _format_args(w: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int],
                                            torch.Tensor | None, tuple[int, int]]:
    weight = w.weight.view(torch.uint8) if w.fmt == "fp8" else w.weight
    if weight.stride(2) != 1:
        raise ValueError("the MoE GEMV needs expert weights with unit stride along K")
    scale = w.scale if w.scale is not None else weight
    strides = (scale.stride(0), scale.stride(1), scale.stride(-1)) if w.scale is not None \
        else (0, 0, 0)
    return weight, scale, strides, w.bias, w.block() or (1, 1)


def fused_moe_gemv(
    x: torch.Tensor,  # [T, K], 1 <= T <= MAX_TOKENS
    w13: ExpertWeights,  # [E, 2I, K]: gate then up
    w2: ExpertWeights,  # [E, K, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    activation: str = "silu",
    limit: float | None = None,
    expert_map: torch.Tensor | None = None,  # [E_global] -> local index or -1
    configs: tuple[dict[str, Any], dict[str, Any]] | None = None,  # (up, down) overrides
) -> torch.Tensor:  # [T, K] in x's dtype
    """fused_moe_ref's contract in two launches (module docstring)."""
    t, top_k = topk_ids.shape
    if not 1 <= t <= (most := max_tokens(w13, x.dtype)):
        raise ValueError(f"the MoE GEMV takes 1..{most} tokens, got {t}")
    hidden, inter = x.shape[1], w13.n // 2
    if configs is None:
        configs = (moe_gemv_config(KERNELS[0], t, w13, x.dtype),
                   moe_gemv_config(KERNELS[1], t, w2, x.dtype))
    up, down = configs
    x = x.contiguous()
    ids = topk_ids.contiguous()
    route = topk_weights.contiguous()
    emap = expert_map if expert_map is not None else ids
    h = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    asm = inline_ptx(x.device)
    for kernel, w, cfg, a, y, n, k in ((kernels.up_kernel, w13, up, x, h, inter, hidden),
                                       (kernels.down_kernel, w2, down, h, out, hidden, inter)):
        weight, scale, s_strides, bias, blk = _format_args(w)
        a8 = _a8(cfg, w, x.dtype)
        block_k = _block_k(k, w, cfg["BLOCK_K"])
        xq, xf = round_x_q8(a) if a8 else (a, a)
        rows = t * top_k if kernel is kernels.up_kernel else t
        grid = (rows, triton.cdiv(n, cfg["BLOCK_N"]))
        kernel[grid](
            a, weight, scale, bias if bias is not None else weight, ids, emap, route, y,
            xq.view(torch.int64) if a8 else a, xf, weight.view(torch.int32) if a8 else weight,
            weight.stride(0), weight.stride(1), *s_strides,
            bias.stride(0) if bias is not None else 0,
            N=n, K=k, TOP_K=top_k, FMT=FMTS[w.fmt], A8=a8, ASM=asm,
            EVEN_K=k % block_k == 0,
            CHANNEL_SCALE=w.fmt == "fp8" and w.block() is None,
            SCALE_BN=blk[0], SCALE_BK=blk[1], HAS_BIAS=bias is not None,
            HAS_MAP=expert_map is not None, SWIGLU=activation == "swiglu_oai",
            LIMIT=float(limit) if limit is not None else 0.0, HAS_LIMIT=limit is not None,
            ALPHA=SWIGLU_ALPHA, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
            NUM_STAGES=cfg["num_stages"], UNROLL=bool(cfg.get("UNROLL", True)),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out
