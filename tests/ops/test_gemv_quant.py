"""The quantized small-batch GEMV (FP8 W8A8, per-row scales; INT8 / INT4 group-wise asymmetric)
against dequantize-then-multiply references over shapes, rows 1..8, bias, group sizes 32 and
128, odd N, FMA and tensor-core modes, split-K on and off; plus the default configurations and
the input checks. On CPU in Triton's interpreter (small shapes, fp32 and fp16 activations).

The interpreter runs the programs one after another, so the operands are laid out to expose what
program order hides: every weight, scale and zero tensor sits at the start of a larger buffer
whose tail is NaN (or 0xFF bytes), and the padding columns of the integer weights past K hold
random codes. A program that reads past a tensor, or gives padding a nonzero weight, then fails
the comparison on CPU as well as on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from skyline.ops.fp8_quant import quantize_rows_fp8_ref  # noqa: E402
from skyline.ops.gemv_quant import (  # noqa: E402
    FP8,
    INT4,
    INT8,
    default_config,
    fp8_gemv_a8,
    fp8_gemv_a8_ref,
    int_gemv,
    int_gemv_ref,
    quant_gemv_config,
    quant_gemv_ok,
    quantize_tiles_fp8_ref,
)
from skyline.ops.int_matmul import dequantize_int_ref  # noqa: E402
from skyline.quant.fp8 import quantize_rows_fp8  # noqa: E402
from skyline.quant.intq import quantize_groups  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def config(block_n: int, block_k: int, split_k: int, use_dot: bool) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "USE_DOT": use_dot,
            "num_warps": 4, "num_stages": 2}


def guarded(t: torch.Tensor) -> torch.Tensor:
    """t (contiguous, on DEV) at the start of a buffer 4096 elements longer whose tail is NaN
    (floating point; 0x7F for e4m3) or 0xFF (uint8): out-of-bounds reads poison the result."""
    fill = 255 if t.dtype == torch.uint8 else float("nan")
    buf = torch.full((t.numel() + 4096,), fill, dtype=t.dtype, device=DEV)
    view = buf[: t.numel()].view(t.shape)
    view.copy_(t)
    return view


def fp8_weights(w: torch.Tensor):
    q, s = quantize_rows_fp8(w)
    return guarded(q.to(DEV)), guarded(s.reshape(-1).to(DEV))


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(DEV, dtype), w, b.to(DEV, dtype)


def int_weights(w: torch.Tensor, bits: int, group: int):
    """Packed codes, scales, zeros (guarded), with random codes in the padding columns past K."""
    codes, scales, zeros = quantize_groups(w, bits, group)
    k = w.shape[1]
    g = torch.Generator().manual_seed(k)
    codes[:, k:] = torch.randint(0, 2**bits, (codes.shape[0], codes.shape[1] - k), generator=g,
                                 dtype=torch.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return guarded(codes.to(DEV)), guarded(scales.to(DEV)), guarded(zeros.to(DEV))


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    rtol, atol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


def test_references_match_dequantized_linear():
    x, w, b = operands(3, 24, 96, torch.float32, seed=1)
    q, s = quantize_rows_fp8(w)
    xq, xs = quantize_rows_fp8(x.cpu())
    wd = q.float() * s
    check(fp8_gemv_a8_ref(xq.to(DEV), xs.to(DEV), q.to(DEV), s.reshape(-1).to(DEV), b,
                          torch.float32), F.linear(xq.float().to(DEV) * xs.to(DEV),
                                                   wd.to(DEV), b))
    for bits in (4, 8):
        c, sc, z = int_weights(w, bits, 32)
        wd = dequantize_int_ref(c, sc, z, bits, 32)[:, :96]
        check(int_gemv_ref(x, c, sc, z, bits, 32, b), F.linear(x, wd, b))


@pytest.mark.parametrize("out_dtype", [torch.float16] + DTYPES[2:])
@pytest.mark.parametrize("x_mode", ["kernel", "row", "block"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 33, 200), (8, 16, 64), (5, 17, 40)])
def test_fp8_gemv_a8_matches_reference(out_dtype, x_mode, split_k, bias, m, n, k):
    # W8A8: x quantized beforehand per row or per row and 128 columns (two blocks at K = 200),
    # or per row and 32-column tile in the kernel; the tensor cores multiply the two fp8
    # tiles. K = 200 and 40 are not multiples of the tile, so the masked tails of x and W are
    # exercised.
    x, w, b = operands(m, n, k, torch.float32, seed=m * n + k + 1)
    q, s = fp8_weights(w)
    b = b.to(out_dtype) if bias else None
    cfg = config(16, 32, split_k, True)
    if x_mode == "kernel":
        xin = guarded(x.to(out_dtype))
        out = fp8_gemv_a8(xin, None, q, s, b, out_dtype, config=cfg)
        ref = fp8_gemv_a8_ref(xin, None, q, s, b, out_dtype, block_k=32)
    else:
        block = 128 if x_mode == "block" else 0
        xq, xs = quantize_rows_fp8_ref(x.cpu(), block)
        assert xs.shape == (m, -(-k // 128) if block else 1)
        xq, xs = guarded(xq.to(DEV)), guarded(xs.to(DEV))
        out = fp8_gemv_a8(xq, xs, q, s, b, out_dtype, config=cfg, x_scale_block=block)
        ref = fp8_gemv_a8_ref(xq, xs, q, s, b, out_dtype, x_scale_block=block)
    assert out.dtype == out_dtype and out.shape == (m, n)
    check(out, ref)
    # the W8A8 product of the original x: within fp8 rounding of x
    exact = F.linear(x.float(), q.float() * s[:, None].float())
    torch.testing.assert_close(out.float(), exact + (b.float() if bias else 0), atol=0.15,
                               rtol=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("use_dot", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 96, True), (3, 33, 200, False),
                                        (8, 16, 64, True), (5, 17, 136, True)])
def test_int_gemv_matches_reference(dtype, bits, group, use_dot, split_k, m, n, k, bias):
    x, w, b = operands(m, n, k, dtype, seed=m * n + k + bits)
    c, s, z = int_weights(w, bits, group)
    b = b if bias else None
    out = int_gemv(x, c, s, z, bits, group, b, config=config(16, 32, split_k, use_dot))
    check(out, int_gemv_ref(x, c, s, z, bits, group, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (2, 33, 200), (5, 17, 136)])
def test_int4_gemv_with_x_left(dtype, split_k, m, n, k):
    # X_LEFT: x the left operand of the tensor-core product (accumulator [rows, outputs],
    # transposed once at the end); same sums as the default DOT layout.
    x, w, b = operands(m, n, k, dtype, seed=m + n + k)
    c, s, z = int_weights(w, 4, 32)
    cfg = {**config(16, 32, split_k, True), "X_LEFT": True}
    check(int_gemv(x, c, s, z, 4, 32, b, config=cfg), int_gemv_ref(x, c, s, z, 4, 32, b))
    with pytest.raises(ValueError, match="X_LEFT"):
        int_gemv(x, c, s, z, 4, 32, b, config={**cfg, "USE_DOT": False})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (2, 33, 200), (5, 17, 136)])
def test_int_gemv_fma_with_broadcast_x(bits, split_k, m, n, k):
    # X_BCAST: x loaded once per tile and broadcast over W's rows (same sums, other layout);
    # K = 200 and 136 are not multiples of the split, so the last splits start past Kp.
    x, w, b = operands(m, n, k, torch.float32, seed=m + n + k + bits)
    c, s, z = int_weights(w, bits, 32)
    cfg = {**config(16, 32, split_k, False), "X_BCAST": True}
    check(int_gemv(x, c, s, z, bits, 32, b, config=cfg), int_gemv_ref(x, c, s, z, bits, 32, b))


@pytest.mark.parametrize("kind,group", [(FP8, 0), (INT4, 32), (INT4, 128), (INT8, 128)])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_default_config_is_valid_and_runs(kind, group, m):
    n, k = 24, 256
    a8 = kind == FP8  # fp8 weights: W8A8 on the tensor cores
    for big_n, big_k in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        cfg = default_config(kind, m, big_n, big_k, group, a8=a8)
        assert cfg["USE_DOT"] == (m > 2 or a8)
        if kind != FP8:
            assert group % cfg["BLOCK_K"] == 0
            row_bytes = cfg["BLOCK_K"] // (2 if kind == INT4 else 1)
            if not cfg["USE_DOT"]:  # 2 KiB of weight bytes x rows per tile (accumulator cap)
                assert cfg["BLOCK_N"] * row_bytes * (1 if m == 1 else 2) >= 2048
    x, w, b = operands(m, n, k, torch.float32, seed=7)
    cfg = default_config(kind, m, n, k, group, a8=a8)
    if kind == FP8:
        q, s = fp8_weights(w)
        x, b = x.half(), b.half()
        check(fp8_gemv_a8(x, None, q, s, b, torch.float16, config=cfg),
              fp8_gemv_a8_ref(x, None, q, s, b, torch.float16, block_k=cfg["BLOCK_K"]))
    else:
        bits = 4 if kind == INT4 else 8
        c, s, z = int_weights(w, bits, group)
        check(int_gemv(x, c, s, z, bits, group, b, config=cfg),
              int_gemv_ref(x, c, s, z, bits, group, b))


@pytest.mark.parametrize("use_dot", [False, True])
def test_split_k_leaves_counters_zeroed_and_repeats_exactly(use_dot):
    # 16 splits of K = 200 in 32-column tiles: splits 7..15 start past K (and past Kp = 224)
    # and must contribute nothing; every launch leaves its tiles' counters at zero for the next
    # (a counter left at 1 would let a later launch's second-to-last split sum missing partials).
    from skyline.ops.gemv import _COUNTERS

    x, w, b = operands(3, 33, 200, torch.float32, seed=9)
    c, s, z = int_weights(w, 4, 32)
    q, qs = fp8_weights(w)
    cfg = config(16, 32, 16, use_dot)
    for _ in range(2):
        outs = [int_gemv(x, c, s, z, 4, 32, b, config=cfg) for _ in range(2)]
        check(outs[0], int_gemv_ref(x, c, s, z, 4, 32, b))
        assert torch.equal(outs[0], outs[1])
        if use_dot:  # the fp8 x fp8 GEMV runs on the tensor cores only
            xh = x.half()
            check(fp8_gemv_a8(xh, None, q, qs, b.half(), torch.float16, config=cfg),
                  fp8_gemv_a8_ref(xh, None, q, qs, b.half(), torch.float16, block_k=32))
        assert not _COUNTERS[x.device].any()


def test_bad_inputs_are_refused():
    x, w, _ = operands(2, 16, 64, torch.float32, seed=3)
    q, s = quantize_rows_fp8(w)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv_a8(x.half(), None, w.to(DEV), s.reshape(-1).to(DEV))
    with pytest.raises(ValueError, match="rows"):
        fp8_gemv_a8(torch.zeros(9, 64, device=DEV).half(), None, q.to(DEV),
                    s.reshape(-1).to(DEV))
    c, sc, z = int_weights(w, 4, 32)
    with pytest.raises(ValueError, match="int4 group-64"):
        int_gemv(x, c, sc, z, 4, 64)
    with pytest.raises(ValueError, match="BLOCK_K must divide"):
        int_gemv(x, c, sc, z, 4, 32, config=config(16, 64, 1, False))
    with pytest.raises(ValueError, match="multiple of 8"):  # int4 FMA reads 8-nibble words
        int_gemv(x, c, sc, z, 4, 32, config=config(16, 4, 1, False))
    xq, xs = quantize_rows_fp8(x)
    with pytest.raises(ValueError, match="USE_DOT"):
        fp8_gemv_a8(xq.to(DEV), xs.to(DEV), q.to(DEV), s.reshape(-1).to(DEV),
                    config=config(16, 32, 1, False))
    with pytest.raises(ValueError, match="float8_e4m3fn with its scales"):
        fp8_gemv_a8(x.half(), xs.to(DEV), q.to(DEV), s.reshape(-1).to(DEV))
    with pytest.raises(ValueError, match="float8_e4m3fn with its scales"):
        fp8_gemv_a8(xq.to(DEV), None, q.to(DEV), s.reshape(-1).to(DEV))
    assert not quant_gemv_ok(torch.zeros(1, 64))  # CPU tensors keep the PyTorch paths


@cuda
@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1031, 14336), (28672, 4096)])
def test_default_configs_on_model_shapes(bits, m, n, k):
    x, w, b = operands(m, n, k, torch.bfloat16, seed=n + k)
    if bits == 0:  # fp8: W8A8, x quantized in the kernel per row and K tile
        q, s = fp8_weights(w)
        block_k = quant_gemv_config(FP8, m, n, k, 0, x.device, True)["BLOCK_K"]
        check(fp8_gemv_a8(x, None, q, s, b),
              fp8_gemv_a8_ref(x, None, q, s, b, torch.bfloat16, block_k=block_k))
    else:
        c, s, z = int_weights(w, bits, 128)
        check(int_gemv(x, c, s, z, bits, 128, b), int_gemv_ref(x, c, s, z, bits, 128, b))


@cuda
def test_linear_methods_dispatch_to_the_gemv():
    from types import SimpleNamespace

    from skyline.quant.fp8 import Fp8LinearMethod
    from skyline.quant.intq import IntLinearMethod

    x, w, b = operands(2, 64, 256, torch.bfloat16, seed=11)
    cfg = SimpleNamespace(group_size=128, prequantized=False)
    for method in (Fp8LinearMethod(cfg), IntLinearMethod(cfg, 4), IntLinearMethod(cfg, 8)):
        params = {k: v.to(DEV) for k, v in method.quantize(w).items()}
        layer = SimpleNamespace(bias=b, **params)
        xr = x.float()
        if isinstance(method, Fp8LinearMethod):  # W8A8: x quantized per row and K tile
            block_k = quant_gemv_config(FP8, 2, 64, 256, 0, x.device, True)["BLOCK_K"]
            xr = quantize_tiles_fp8_ref(x, block_k)
        ref = F.linear(xr, method.dequantize(params, 256).float(), b.float())
        out = method.apply(layer, x)
        assert out.shape == (2, 64) and out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


@cuda
@pytest.mark.parametrize("rows_first", [False, True])
def test_fp8_linear_decode_gemv(rows_first):
    # the fp8 product at decode-sized batches against its reference: x quantized in the GEMV
    # per row and K tile (a Linear's input no producer quantized), or per row by a launch of
    # its own first (the fp8 LM head)
    from skyline.ops.fp8_linear import fp8_linear

    x, w, b = operands(3, 64, 512, torch.bfloat16, seed=12)
    q, s = fp8_weights(w)
    out = fp8_linear(x, q, s, b, rows_first=rows_first)
    if rows_first:
        xq, xs = quantize_rows_fp8(x)
        ref = fp8_gemv_a8_ref(xq, xs, q, s, b, torch.bfloat16)
    else:
        block_k = quant_gemv_config(FP8, 3, 64, 512, 0, x.device, True)["BLOCK_K"]
        ref = fp8_gemv_a8_ref(x, None, q, s, b, torch.bfloat16, block_k=block_k)
    check(out, ref)
