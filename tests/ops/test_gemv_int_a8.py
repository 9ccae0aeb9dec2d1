"""The W4A8 GEMV (ops/gemv_int_a8.py: INT4 weights against int8 x by dp4a) against its
reference over rows 1..8, K tails, group sizes, split-K, scales stored row- or group-major, bias
and dtypes; the rounding of x; its distance from the weight-only product; the input checks; and
the INT4 Linear's modes. On CPU in Triton's interpreter (the portable byte-by-byte dot), on a
GPU with the PTX routine.

Every weight, scale and zero tensor sits at the start of a larger buffer whose tail is NaN (or
0xFF bytes), and the padding columns past K hold random codes, so a program that reads past a
tensor or gives padding a weight fails the comparison on CPU as well."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.ops.gemv_int_a8 import (  # noqa: E402
    default_config,
    int4_gemv_a8,
    int4_gemv_a8_ref,
    int8_chunks_ref,
    quantize_chunks_int8_ref,
    round_to_int8_chunks,
)
from skyline.ops.gemv_quant import int_gemv_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cfg(block_n: int, block_k: int, split_k: int, prefetch: bool = False) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4,
            "num_stages": 1, "PREFETCH": prefetch}


def tailed(t: torch.Tensor, fill: float | int) -> torch.Tensor:
    """t's values at the start of a buffer twice its size whose tail is `fill`."""
    buf = torch.full((2 * t.numel(),), fill, dtype=t.dtype, device=t.device)
    buf[: t.numel()] = t.reshape(-1)
    return buf[: t.numel()].view(t.shape)


def weights(n: int, k: int, group: int, group_major: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    qweight = torch.randint(0, 256, (n, groups * group // 2), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    qweight, scales, zeros = (t.to(DEV) for t in (qweight, scales, zeros))
    if group_major:  # [G, N] in memory, seen as [N, G]
        st = tailed(scales.t().contiguous(), float("nan"))
        zt = tailed(zeros.t().contiguous(), 0xFF)
        return tailed(qweight, 0xFF), st.t(), zt.t()
    return tailed(qweight, 0xFF), tailed(scales, float("nan")), tailed(zeros, 0xFF)


def check(x: torch.Tensor, args: tuple, group: int, config: dict | None,
          bias: torch.Tensor | None = None) -> None:
    y = int4_gemv_a8(x, *args, group, bias=bias, config=config)
    ref = int4_gemv_a8_ref(x, *args, group, bias=bias)
    assert y.shape == ref.shape and y.dtype == x.dtype
    scale = ref.float().abs().max().item() + 1e-6
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= TOL[x.dtype] * scale, (err, scale)


@pytest.mark.parametrize("m,n,k,group,config", [
    (1, 64, 256, 128, None),
    (1, 33, 1000, 128, cfg(16, 1024, 1)),  # K tail, one tile past K
    (2, 40, 200, 64, cfg(16, 64, 3)),  # splits whose tiles start past K
    (3, 17, 512, 32, cfg(32, 128, 2)),
    (8, 16, 96, 32, cfg(16, 32, 1)),
    (5, 48, 384, 128, cfg(16, 256, 2)),
    (1, 40, 1024, 128, cfg(8, 256, 1, True)),  # next tile loaded ahead, 4 tiles
    (4, 20, 2048, 64, cfg(16, 256, 2, True)),  # ahead within each split
    (2, 24, 1000, 128, cfg(8, 256, 2, True)),  # K tail: no loads ahead
])
@pytest.mark.parametrize("group_major", [False, True])
def test_matches_reference(m, n, k, group, config, group_major):
    torch.manual_seed(m * 1000 + n + k)
    args = weights(n, k, group, group_major, seed=n + k)
    x = torch.randn(m, k, device=DEV) * 3
    check(x, args, group, config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_bias_and_leading_dims(dtype):
    torch.manual_seed(1)
    args = weights(24, 160, 32)
    x = torch.randn(2, 3, 160, device=DEV).to(dtype)
    bias = torch.randn(24, device=DEV).to(dtype)
    y = int4_gemv_a8(x, *args, 32, bias=bias, config=cfg(16, 64, 2))
    ref = int4_gemv_a8_ref(x, *args, 32, bias=bias)
    assert y.shape == (2, 3, 24)
    scale = ref.float().abs().max().item()
    assert (y.float() - ref.float()).abs().max().item() <= TOL[dtype] * scale


def test_zero_and_sparse_rows():
    """An all-zero chunk keeps scale 1 and codes 0 (no 0 * inf); a lone value is exact."""
    args = weights(16, 128, 32)
    x = torch.zeros(2, 128, device=DEV)
    x[1, 70] = -5.0
    check(x, args, 32, cfg(16, 64, 1))
    q, s = quantize_chunks_int8_ref(x)
    assert s[0].eq(1).all() and q[0].eq(0).all()
    assert q[1, 70].item() == -127 and s[1, 2].item() == pytest.approx(5 / 127)


@pytest.mark.parametrize("m,k", [(1, 4096), (3, 1000), (8, 96), (2, 33)])
def test_round_to_int8_chunks_kernel(m, k):
    """The rounding launch writes int8_chunks_ref's words and floats bit for bit (the tail of a
    part-filled chunk rounds as zeros), and the GEMV gives the same result for x and its
    rounding handed over."""
    torch.manual_seed(m + k)
    x = torch.randn(m, k, device=DEV) * torch.logspace(-2, 1, k, device=DEV)
    got, ref = round_to_int8_chunks(x), int8_chunks_ref(x)
    assert got.cols == ref.cols == k and got.dtype == ref.dtype == x.dtype
    assert torch.equal(got.words, ref.words.to(DEV))
    assert torch.equal(got.floats, ref.floats.to(DEV))
    args = weights(24, k, 32)
    y = int4_gemv_a8(ref, *args, 32, config=cfg(16, 128, 1))
    assert y.shape == (m, 24)
    assert torch.equal(y, int4_gemv_a8(x, *args, 32, config=cfg(16, 128, 1)))


def test_int8_chunks_ref_words():
    """Word j of a row holds the codes of columns 8j, 8j + 2, .. (even plane) and 8j + 1, ..
    (odd plane), lowest byte first, two's complement."""
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([127.0, -1, 2, -3, 4, -5, 6, -7])  # amax 127: codes = values
    r = int8_chunks_ref(x)
    even = [127, 2, 4, 6]
    odd = [-1, -3, -5, -7]
    pack = lambda v: int.from_bytes(bytes(b & 0xFF for b in v), "little", signed=True)  # noqa: E731
    assert r.words[0, 0, 0].item() == pack(even) and r.words[1, 0, 0].item() == pack(odd)
    assert r.words[:, 0, 1:].eq(0).all()
    assert r.floats[0, 0].tolist() == [1.0, float(sum(even) + sum(odd))]


def test_rounding_half_away_from_zero():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, 2.5, -2.5, 0.49])  # scale 1: 127 / amax = 1
    q, s = quantize_chunks_int8_ref(x)
    assert s.item() == 1.0
    assert q[0, :4].tolist() == [127, 3, -3, 0]


def test_rounding_error_bounded():
    torch.manual_seed(2)
    x = torch.randn(3, 256) * torch.logspace(-3, 2, 256)  # chunks of very different ranges
    q, s = quantize_chunks_int8_ref(x)
    xd = q.float() * s.repeat_interleave(32, dim=1)
    assert q.abs().max() <= 127
    bound = s.repeat_interleave(32, dim=1) * 0.5 * (1 + 1e-5)
    assert ((xd - x).abs() <= bound).all()


def test_close_to_weight_only():
    """W4A8 differs from the exact INT4 product only by x's int8 rounding (~0.2%)."""
    torch.manual_seed(3)
    args = weights(64, 512, 128)
    x = torch.randn(2, 512, device=DEV)
    exact = int_gemv_ref(x, *args, 4, 128).float()
    a8 = int4_gemv_a8_ref(x, *args, 128).float()
    rel = (a8 - exact).norm() / exact.norm()
    assert 0 < rel.item() < 0.01


def test_default_config():
    for n, k in [(4096, 4096), (28672, 4096), (4096, 14336), (8, 96)]:
        c = default_config(1, n, k)
        assert c["BLOCK_K"] >= 32 and c["BLOCK_K"] & (c["BLOCK_K"] - 1) == 0
        assert c["SPLIT_K"] == 1 or k // (c["SPLIT_K"] * c["BLOCK_K"]) >= 1


@pytest.mark.parametrize("bad", ["group", "zeros", "rows", "bias", "block_k"])
def test_input_errors(bad):
    args = list(weights(16, 96, 32))
    x = torch.randn(1, 96, device=DEV)
    group, bias, config = 32, None, None
    if bad == "group":  # groups of 16: not a multiple of x's 32-column chunks
        args = list(weights(16, 96, 16))
        group = 16
    elif bad == "zeros":
        args[2] = args[2].float()
    elif bad == "rows":
        x = torch.randn(9, 96, device=DEV)
    elif bad == "bias":
        bias = torch.zeros(15, device=DEV)
    else:
        config = cfg(16, 48, 1)
    with pytest.raises(ValueError, match="int4_gemv_a8"):
        int4_gemv_a8(x, *args, group, bias=bias, config=config)


def test_linear_paths():
    """CUDA decode rows run the W4A8 GEMV (its reference's values), other inputs (CPU, more
    than 8 rows) keep the exact weight-only path; on CUDA decode rows the layer asks the
    producer for x rounded."""
    from types import SimpleNamespace

    from skyline.model.layers.linear import Linear
    from skyline.quant import intq

    torch.manual_seed(4)
    method = intq.IntLinearMethod(SimpleNamespace(group_size=32, prequantized=False,
                                                  layout=None), 4)
    layer = Linear(96, 40, bias=False, linear_method=method)
    w = torch.randn(40, 96) * 0.1
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    layer.to(DEV)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32  # the GEMVs take bf16 / fp16
    x = torch.randn(2, 96, device=DEV).to(dtype)
    args = (layer.qweight, layer.scales, layer.zeros)
    y = layer(x).float()
    if DEV == "cuda":
        ref = int4_gemv_a8_ref(x, *args, 32).float()
    else:
        ref = int_gemv_ref(x, *args, 4, 32)
    assert (y - ref).abs().max().item() <= TOL[dtype] * ref.abs().max().item()
    # a producer's rounding, handed over when the layer asks for it (on CUDA decode rows)
    assert layer.input_quant(x) == ("int8" if DEV == "cuda" else None)
    yc = layer(int8_chunks_ref(x)).float()
    assert (yc - int4_gemv_a8_ref(x, *args, 32).float()).abs().max().item() <= (
        TOL[dtype] * ref.abs().max().item())
    xl = torch.randn(9, 96, device=DEV).to(dtype)  # past the GEMV's rows: weight-only
    exact = int_gemv_ref(xl, *args, 4, 32).float()
    err = (layer(xl).float() - exact).abs().max().item()
    assert err <= 2 * TOL[dtype] * exact.abs().max().item()


@cuda
def test_cuda_bf16_llama_shapes():
    """The PTX routine on the GPU at a real projection shape, tuned configuration."""
    for n, k in [(6144, 4096), (4096, 14336)]:
        args = weights(n, k, 128)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        check(x, args, 128, None)
