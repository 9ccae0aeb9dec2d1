"""The block-scaled GEMV (ops/gemv_block.py), its dequantizer and linear (ops/block_linear.py):
NVFP4, MXFP4, GGUF Q6_K and Q5_K read as stored, against their references: rows 1..64 (tiles of
16-64 rows past 8), odd N, K not a multiple of the tile (FP4), tensor-core and integer (x rounded
to int8, against the reference that rounds x the same way) modes, split-K on and off, bias; the
dequantizer exact (GGUF) against ops/dequant.py. On CPU in Triton's interpreter (tiny shapes,
fp32 and fp16 activations).

Every stored tensor sits at the start of a larger buffer whose tail is 0xFF bytes (NaN scales),
and the FP4 formats' padding columns past K hold random codes: a program that reads past a
tensor, or gives padding a nonzero weight, fails the comparison."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

triton = pytest.importorskip("triton")

from skyline.bench.gguf_blocks import random_blocks  # noqa: E402
from skyline.ops.block_linear import (  # noqa: E402
    LINEAR_ROWS,
    gguf_dequantize,
    gguf_linear,
    mxfp4_dequantize,
    mxfp4_linear,
    nvfp4_dequantize,
    nvfp4_linear,
)
from skyline.ops.dequant import dequantize_ref  # noqa: E402
from skyline.ops.fp4 import dequantize_mxfp4, dequantize_nvfp4  # noqa: E402
from skyline.ops.gemv_block import (  # noqa: E402
    MAX_BLOCK_ROWS,
    MXFP4,
    NVFP4,
    Q5_K,
    Q6_K,
    block_gemv_ok,
    default_config,
    gguf_gemv,
    gguf_gemv_ref,
    mxfp4_gemv,
    mxfp4_gemv_ref,
    nvfp4_gemv,
    nvfp4_gemv_ref,
)
from skyline.quant.fp4 import quantize_mxfp4, quantize_nvfp4  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
cuda = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def guarded(t: torch.Tensor) -> torch.Tensor:
    """t (on DEV) at the start of a buffer 4096 bytes longer whose tail is 0xFF."""
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    buf = torch.full((raw.numel() + 4096,), 255, dtype=torch.uint8, device=DEV)
    buf[: raw.numel()].copy_(raw)
    return buf[: raw.numel()].view(t.dtype).view(t.shape)


def nvfp4_weights(n: int, k: int, seed: int):
    """(codes, scales, tensor_scale [N]) of random weights, guarded, random codes past K."""
    g = torch.Generator().manual_seed(seed)
    q, s, ts = quantize_nvfp4(torch.randn(n, k, generator=g) / k**0.5)
    codes = torch.stack([q & 15, q >> 4], -1).flatten(-2)
    codes[:, k:] = torch.randint(0, 16, (n, codes.shape[1] - k), generator=g, dtype=torch.uint8)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4)
    # a merged layer holds one tensor scale per row (each shard its own)
    ts = ts.expand(n) * torch.linspace(0.5, 2.0, n)
    return guarded(q.to(DEV)), guarded(s.to(DEV)), guarded(ts.contiguous().to(DEV))


def mxfp4_weights(n: int, k: int, seed: int):
    """(codes, E8M0 scales) of random weights, guarded, random codes past K."""
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_mxfp4(torch.randn(n, k, generator=g) / k**0.5)
    codes = torch.stack([q & 15, q >> 4], -1).flatten(-2)
    codes[:, k:] = torch.randint(0, 16, (n, codes.shape[1] - k), generator=g, dtype=torch.uint8)
    q = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return guarded(q.to(DEV)), guarded(s.to(DEV))


def gguf_weights(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    return guarded(random_blocks(qtype, n, k, seed).to(DEV))


def cfg(block_n: int, block_k: int, split_k: int, mode: str) -> dict:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "A8": mode == "a8",
            "num_warps": 4, "num_stages": 1}


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    return x, b


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    rtol, atol = TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = max(1.0, ref.float().abs().max().item())
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k,mode", [(1, "dot"), (3, "dot"), (1, "a8"), (3, "a8")])
@pytest.mark.parametrize("m,n,k,bias", [(1, 7, 200, True), (2, 33, 64, False),
                                        (5, 17, 200, False), (8, 16, 72, True)])
def test_nvfp4_gemv_matches_reference(dtype, split_k, mode, m, n, k, bias):
    q, s, ts = nvfp4_weights(n, k, seed=m * n + k)
    x, b = operands(m, n, k, dtype, seed=k, bias=bias)
    out = nvfp4_gemv(x, q, s, ts, b, config=cfg(16, 64, split_k, mode))
    check(out, nvfp4_gemv_ref(x, q, s, ts, b, a8=mode == "a8"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k,mode,block_k", [(1, "dot", 64), (3, "dot", 32), (1, "a8", 32),
                                                  (3, "a8", 64), (2, "a8", 128)])
@pytest.mark.parametrize("m,n,k,bias", [(1, 7, 200, True), (2, 33, 64, False),
                                        (5, 17, 232, False), (8, 16, 96, True)])
def test_mxfp4_gemv_matches_reference(dtype, split_k, mode, block_k, m, n, k, bias):
    q, s = mxfp4_weights(n, k, seed=m * n + k)
    x, b = operands(m, n, k, dtype, seed=k, bias=bias)
    out = mxfp4_gemv(x, q, s, b, config=cfg(16 if mode == "dot" else 4, block_k, split_k, mode))
    check(out, mxfp4_gemv_ref(x, q, s, b, a8=mode == "a8"))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,split_k,mode,bias", [
    (1, 5, 2, "dot", True), (4, 17, 3, "dot", True), (8, 9, 1, "dot", False),
    (1, 5, 1, "a8", True), (2, 17, 3, "a8", False),
    (4, 9, 2, "a8", True), (1, 6, 1, "a8_512", False), (2, 5, 2, "a8_1024", True)])
def test_gguf_gemv_matches_reference(qtype, dtype, m, n, split_k, mode, bias):
    # K = 768: three super-blocks, so three splits leave one empty tile past K for split 2... 3
    # (Q6_K rows of 630 bytes: every other super-block starts off a 4-byte boundary)
    data = gguf_weights(qtype, n, 768, seed=n)
    x, b = operands(m, n, 768, dtype, seed=m, bias=bias)
    # a8_512 / a8_1024: tiles of two / four super-blocks (the last tile partly past K)
    block_k = int(mode[3:]) if mode.startswith("a8_") else 256
    mode = mode[:2] if mode.startswith("a8_") else mode
    out = gguf_gemv(x, data, qtype, b,
                    config=cfg(16 if mode == "dot" else 4, block_k, split_k, mode))
    check(out, gguf_gemv_ref(x, data, qtype, b, a8=mode == "a8"))


@pytest.mark.parametrize("m,split_k", [(12, 1), (33, 2), (64, 1)])
def test_tiles_of_many_rows_match_the_references(m, split_k):
    """Decode batches past 8 rows: the tensor-core mode, tiles of 16, 64 and 64 rows of x."""
    x, b = operands(m, 21, 256, torch.float16, seed=m, bias=True)
    c = cfg(16, 256 if split_k == 1 else 64, split_k, "dot")
    q, s, ts = nvfp4_weights(21, 256, seed=m)
    check(nvfp4_gemv(x, q, s, ts, b, config=c), nvfp4_gemv_ref(x, q, s, ts, b))
    mq, ms = mxfp4_weights(21, 256, seed=m)
    check(mxfp4_gemv(x, mq, ms, b, config=c), mxfp4_gemv_ref(x, mq, ms, b))
    data = gguf_weights(Q.Q5_K, 21, 256, seed=m)
    check(gguf_gemv(x, data, Q.Q5_K, b, config=cfg(16, 256, 1, "dot")),
          gguf_gemv_ref(x, data, Q.Q5_K, b))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K], ids=lambda q: q.name)
def test_gguf_dequantize_is_exact(qtype):
    data = gguf_weights(qtype, 19, 512, seed=3)
    out = torch.full((19, 512), float("nan"), device=DEV)
    assert torch.equal(gguf_dequantize(data, qtype, out), dequantize_ref(data, qtype))


def test_nvfp4_dequantize_matches_the_format():
    q, s, ts = nvfp4_weights(21, 200, seed=5)
    out = torch.full((21, 200), float("nan"), device=DEV)
    want = dequantize_nvfp4(q, s, ts)[:, :200]
    torch.testing.assert_close(nvfp4_dequantize(q, s, ts, out), want, rtol=1e-6, atol=0)


def test_mxfp4_dequantize_is_exact():
    q, s = mxfp4_weights(21, 200, seed=5)
    out = torch.full((21, 200), float("nan"), device=DEV)
    assert torch.equal(mxfp4_dequantize(q, s, out), dequantize_mxfp4(q, s)[:, :200])


@pytest.mark.parametrize("chunk_bytes", [1, 16 * 512 * 4 * 2, 1 << 30])
def test_linear_dequantizes_in_chunks_of_rows(chunk_bytes):
    # More rows than the GEMV takes: the weights go through the scratch buffer in chunks of
    # 16 rows (smallest), 32 rows (a last chunk of 5) or whole, each chunk one matmul.
    x, b = operands(MAX_BLOCK_ROWS + 3, 37, 512, torch.float32, seed=2, bias=True)
    q, s, ts = nvfp4_weights(37, 512, seed=2)
    check(nvfp4_linear(x, q, s, ts, b, chunk_bytes=chunk_bytes), nvfp4_gemv_ref(x, q, s, ts, b))
    q, s = mxfp4_weights(37, 512, seed=2)
    check(mxfp4_linear(x, q, s, b, chunk_bytes=chunk_bytes), mxfp4_gemv_ref(x, q, s, b))
    for qtype in (Q.Q6_K, Q.Q5_K):
        data = gguf_weights(qtype, 37, 512, seed=2)
        check(gguf_linear(x, data, qtype, b, chunk_bytes=chunk_bytes),
              gguf_gemv_ref(x, data, qtype, b))


def test_default_configs_are_valid_launches():
    for fmt in (NVFP4, Q6_K, Q5_K, MXFP4):
        for m in (1, 2, 4, 8):
            c = default_config(fmt, m, 4096, 4096)
            a8 = m <= (2 if fmt == Q6_K else 4)
            assert c["BLOCK_K"] % 256 == 0 and c["A8"] == a8
            assert c["BLOCK_N"] >= (1 if a8 else 16)
            assert 4096 // c["SPLIT_K"] >= (2 if c["A8"] else 4) * c["BLOCK_K"]


def test_bad_inputs_say_what_is_wrong():
    q, s, ts = nvfp4_weights(4, 64, seed=0)
    x = torch.randn(1, 64, device=DEV)
    with pytest.raises(ValueError, match="not NVFP4 weights"):
        nvfp4_gemv(x, q, s.view(torch.uint8), ts)
    with pytest.raises(ValueError, match="not Q6_K or Q5_K"):
        gguf_gemv(torch.randn(1, 256, device=DEV), random_blocks(Q.Q4_K, 2, 256, 0), Q.Q4_K)
    with pytest.raises(ValueError, match="not Q6_K blocks of 512 columns"):
        gguf_gemv(torch.randn(1, 512, device=DEV), gguf_weights(Q.Q6_K, 2, 256, 0), Q.Q6_K)
    with pytest.raises(ValueError, match="1..64 rows"):
        nvfp4_gemv(torch.randn(MAX_BLOCK_ROWS + 1, 64, device=DEV), q, s, ts)
    with pytest.raises(ValueError, match="the integer mode takes 1..8 rows"):
        nvfp4_gemv(torch.randn(9, 64, device=DEV), q, s, ts, config=cfg(4, 64, 1, "a8"))
    with pytest.raises(ValueError, match="GGUF tiles are one super-block"):
        gguf_gemv(torch.randn(1, 256, device=DEV), gguf_weights(Q.Q5_K, 2, 256, 0), Q.Q5_K,
                  config=cfg(16, 128, 1, "dot"))
    with pytest.raises(ValueError, match="A8 needs BLOCK_K >= 32"):
        nvfp4_gemv(x, q, s, ts, config=cfg(4, 16, 1, "a8"))
    mq, ms = mxfp4_weights(4, 64, seed=0)
    with pytest.raises(ValueError, match="not MXFP4 weights for K = 64"):
        mxfp4_gemv(x, mq, ms.view(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="not MXFP4 weights for K = 96"):
        mxfp4_gemv(torch.randn(1, 96, device=DEV), mq, ms)
    with pytest.raises(ValueError, match="MXFP4 needs BLOCK_K a power of two >= 32"):
        mxfp4_gemv(x, mq, ms, config=cfg(16, 16, 1, "dot"))


def test_gemv_is_only_taken_on_cuda_for_16_bit_decode_batches():
    assert not block_gemv_ok(torch.randn(1, 64, dtype=torch.float16))  # CPU
    if DEV == "cuda":
        assert block_gemv_ok(torch.randn(64, 64, dtype=torch.bfloat16, device=DEV))
        assert not block_gemv_ok(torch.randn(65, 64, dtype=torch.bfloat16, device=DEV))
        assert not block_gemv_ok(torch.randn(2, 64, device=DEV))
        assert not block_gemv_ok(torch.randn(17, 64, dtype=torch.bfloat16, device=DEV),
                                 LINEAR_ROWS[NVFP4])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 40])
def test_linear_paths_on_cuda_match_the_references(rows):
    # default configurations (split K; integer mode up to 4 rows (Q6_K 2), tensor cores above)
    # at a real-ish shape; past LINEAR_ROWS (FP4 16, GGUF 8) the scratch buffer and a matmul
    q, s, ts = nvfp4_weights(1000, 2048, seed=rows)
    x, b = operands(rows, 1000, 2048, torch.bfloat16, seed=rows, bias=True)
    check(nvfp4_linear(x, q, s, ts, b), nvfp4_gemv_ref(x, q, s, ts, b, a8=rows <= 4))
    mq, ms = mxfp4_weights(1000, 2048, seed=rows)
    check(mxfp4_linear(x, mq, ms, b), mxfp4_gemv_ref(x, mq, ms, b, a8=rows <= 4))
    for qtype in (Q.Q6_K, Q.Q5_K):
        data = gguf_weights(qtype, 1000, 2048, seed=rows)
        a8 = rows <= (2 if qtype == Q.Q6_K else 4)
        check(gguf_linear(x, data, qtype, b), gguf_gemv_ref(x, data, qtype, b, a8=a8))


@pytest.mark.cuda
@cuda
def test_gemvs_replay_in_a_cuda_graph():
    q, s, ts = nvfp4_weights(4096, 4096, seed=1)
    data = gguf_weights(Q.Q6_K, 4096, 4096, seed=1)
    x = torch.randn(2, 4096, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):  # warm: compile, and the split-K counters exist before the capture
        nvfp4_gemv(x, q, s, ts), gguf_gemv(x, data, Q.Q6_K)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1, y2 = nvfp4_gemv(x, q, s, ts), gguf_gemv(x, data, Q.Q6_K)
    x.copy_(torch.randn_like(x))
    graph.replay()
    check(y1, nvfp4_gemv_ref(x, q, s, ts, a8=True))
    check(y2, gguf_gemv_ref(x, data, Q.Q6_K, a8=True))
