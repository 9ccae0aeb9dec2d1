"""ops/dequant.py against gguf's numpy reference (`gguf.quants.dequantize`)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from skyline.ops.dequant import GGML_TYPES, dequantize_ref

BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]  # types gguf.quants can quantize
SHAPES = [(1, 256), (3, 512), (17, 768)]  # rows x cols; cols a multiple of 256 fits every type

# byte offsets of the fp16 scales in each block type; every other byte is free
FP16_AT = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with finite, moderate fp16 scales: [rows, bytes_per_row] uint8."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_size
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        scale = rng.uniform(-2.0, 2.0, size=n).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // block_size * type_size)


def check(data: np.ndarray, qtype: Q) -> None:
    want = torch.from_numpy(dequantize(data, qtype).astype(np.float32))
    got = dequantize_ref(torch.from_numpy(data.copy()), qtype)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want), (qtype.name, (got - want).abs().max())


def test_table_matches_gguf() -> None:
    for qtype, (_, block_size, type_size) in GGML_TYPES.items():
        assert GGML_QUANT_SIZES[Q(qtype)] == (block_size, type_size)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_blocks(qtype: Q, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{qtype.name}{shape}".encode()))
    check(random_blocks(qtype, *shape, rng), qtype)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(4, 64), (9, 576)], ids=str)
def test_quantized_real_floats(qtype: Q, shape: tuple[int, int]) -> None:
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    data = quantize(x, qtype)
    check(data, qtype)
    # the round trip is close to the input: dequantization decodes what quantization meant
    err = np.abs(dequantize_ref(torch.from_numpy(data), qtype).numpy() - x).max()
    assert err < {Q.Q8_0: 0.05}.get(qtype, 0.6)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(7,), (3, 40)], ids=str)
def test_float_types(qtype: Q, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    data = quantize(x, qtype)
    check(data, qtype)  # F32/F16 as the reader gives them (float arrays)
    check(data.view(np.uint8), qtype)  # and as raw bytes


def test_leading_dims_and_errors() -> None:
    rng = np.random.default_rng(2)
    data = random_blocks(Q.Q4_K, 6, 512, rng)
    got = dequantize_ref(torch.from_numpy(data).reshape(2, 3, -1), Q.Q4_K)
    assert got.shape == (2, 3, 512)
    assert torch.equal(got.reshape(6, 512), dequantize_ref(torch.from_numpy(data), Q.Q4_K))
    with pytest.raises(ValueError, match="IQ2_XXS|supported"):
        dequantize_ref(torch.from_numpy(data), Q.IQ2_XXS)
    with pytest.raises(ValueError, match="blocks"):
        dequantize_ref(torch.from_numpy(data[:, :-1].copy()), Q.Q4_K)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", BLOCK_TYPES + [Q.F16, Q.BF16], ids=lambda q: q.name)
def test_cuda_matches_cpu(qtype: Q) -> None:
    rng = np.random.default_rng(3)
    if qtype in (Q.F16, Q.BF16):
        data = quantize(rng.standard_normal((5, 256)).astype(np.float32), qtype).view(np.uint8)
    else:
        data = random_blocks(qtype, 5, 512, rng)
    cpu = dequantize_ref(torch.from_numpy(data), qtype)
    gpu = dequantize_ref(torch.from_numpy(data).cuda(), qtype)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
