"""The Triton RMSNorm kernel (plain, fused with the residual add, per head of a strided q/k view)
against the PyTorch reference over a sweep of shapes and dtypes. Runs on CUDA, or in Triton's
interpreter on CPU (small sizes; see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.ops.fp8_quant import FP8, quantize_rows_fp8_ref  # noqa: E402
from skyline.ops.gemv_int_a8 import int8_chunks_ref  # noqa: E402
from skyline.ops.norm import (  # noqa: E402
    CPU_FEW_ROWS,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm,
    rms_norm_cpu,
    rms_norm_ref,
    rms_norm_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(DEV == "cpu", reason="large sweep: CUDA only")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# CPU: Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest), hence
# tolerances of about two units in the last place.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
HIDDEN = [64, 96, 576] + [pytest.param(d, marks=CUDA_ONLY) for d in (1000, 4096, 5120, 8192)]
TOKENS = [1, 7, 33, pytest.param(100, marks=CUDA_ONLY)]


def close(got: torch.Tensor, want: torch.Tensor, rounded_to: torch.dtype | None = None) -> None:
    # rounded_to: the dtype the values were rounded through (default: their own)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[rounded_to or want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def inputs(num_tokens: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + num_tokens * 7 + d)
    x = (torch.randn(num_tokens, d, generator=g) * 3).to(DEV, dtype)
    residual = torch.randn(num_tokens, d, generator=g).to(DEV, dtype)
    weight = (torch.rand(d, generator=g) + 0.5).to(DEV, dtype)
    return x, residual, weight


@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(d, num_tokens, dtype):
    x, _, w = inputs(num_tokens, d, dtype)
    x_before = x.clone()
    close(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    assert torch.equal(x, x_before)  # plain RMSNorm leaves its input alone


@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_in_place(d, num_tokens, dtype):
    x, residual, w = inputs(num_tokens, d, dtype, seed=1)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    out, res = fused_add_rms_norm_triton(x, residual, w, 1e-6)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == residual.data_ptr()
    close(out, want_out)
    close(res, want_res)


@pytest.mark.parametrize("config", [{"BLOCK_M": 1, "num_warps": 1}, {"BLOCK_M": 4, "num_warps": 2},
                                    {"BLOCK_M": 16, "num_warps": 4}])
def test_launch_configs_agree(config):
    # Every configuration the tuner may pick computes the same thing, rows that do not fill a
    # block included (num_tokens 37).
    x, residual, w = inputs(37, 96, torch.float32, seed=2)
    close(rms_norm_triton(x, w, 1e-6, config), rms_norm_ref(x, w, 1e-6))
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    out, res = fused_add_rms_norm_triton(x, residual, w, 1e-6, config)
    close(out, want_out)
    close(res, want_res)


@pytest.mark.parametrize("num_heads,head_dim", [(4, 16), (6, 80), pytest.param(32, 128,
                                                                               marks=CUDA_ONLY)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_strided_view(num_heads, head_dim, dtype):
    # Qwen3's q norm: the q part of a qkv projection, [T, heads, head_dim] with row stride of
    # the whole qkv row; the rest of the row stays untouched.
    num_tokens = 9
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 4) * head_dim, generator=g).to(DEV, dtype)
    q = qkv[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    w = (torch.rand(head_dim, generator=g) + 0.5).to(DEV, dtype)
    qkv_before = qkv.clone()
    out = rms_norm_triton(q, w, 1e-6)
    assert out.is_contiguous()
    close(out, rms_norm_ref(q, w, 1e-6))
    assert torch.equal(qkv, qkv_before)


def test_weight_in_float32_promotes_as_reference():
    x, _, w = inputs(5, 64, torch.bfloat16)
    # the normed bf16 values times a float32 weight: a float32 result, as torch promotes
    close(rms_norm_triton(x, w.float(), 1e-6), rms_norm_ref(x, w.float(), 1e-6), torch.bfloat16)


@pytest.mark.parametrize("rows", [3, CPU_FEW_ROWS + 1])
def test_dispatch_on_cpu_is_the_reference(rows):
    # a few rows (decode) take rms_norm_cpu (tests/ops/test_cpu_decode_ops.py), more the
    # reference itself; the inputs are never written
    x, residual, w = torch.randn(rows, 32), torch.randn(rows, 32), torch.rand(32)
    x_before, res_before = x.clone(), residual.clone()
    norm = rms_norm_cpu if rows <= CPU_FEW_ROWS else rms_norm_ref
    assert torch.equal(rms_norm(x, w, 1e-6), norm(x, w, 1e-6))
    close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    out, res = fused_add_rms_norm(x, residual, w, 1e-6)
    want_out, want_res = fused_add_rms_norm_ref(x_before, res_before, w, 1e-6)
    assert torch.equal(res, want_res) and torch.equal(out, norm(want_res, w, 1e-6))
    close(out, want_out)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dispatch_on_cuda_is_in_place_and_graph_safe():
    x, residual, w = inputs(16, 4096, torch.bfloat16, seed=3)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-5)
    out, res = fused_add_rms_norm(x, residual, w, 1e-5)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == residual.data_ptr()
    close(out, want_out)
    close(res, want_res)
    # Captured once, replayed on new data: no host syncs, no data-dependent allocation.
    sx, sr = torch.zeros_like(x), torch.zeros_like(x)
    rms_norm(sx, w, 1e-5)  # warm-up (compilation) outside the capture
    fused_add_rms_norm(sx.clone(), sr.clone(), w, 1e-5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_add_rms_norm(sx, sr, w, 1e-5)
        plain = rms_norm(sr, w, 1e-5)
    x2, r2, _ = inputs(16, 4096, torch.bfloat16, seed=4)
    sx.copy_(x2)
    sr.copy_(r2)
    graph.replay()
    want_out, want_res = fused_add_rms_norm_ref(x2, r2, w, 1e-5)
    close(sx, want_out)
    close(sr, want_res)
    close(plain, rms_norm_ref(want_res, w, 1e-5))


def same_fp8_rows(got, want_values: torch.Tensor) -> None:
    # got (Fp8Rows): exactly the values and scales the reference quantization makes of the
    # unquantized result, and its dtype. float32 rows (which no fp8 GEMV takes) may differ from
    # the unquantized kernel's in the last bit on a GPU (another contraction of the sum of
    # squares into FMAs): there within one e4m3 rounding.
    q_ref, s_ref = quantize_rows_fp8_ref(want_values)
    assert got.dtype == want_values.dtype and got.q.dtype == FP8 and got.block == 0
    if want_values.dtype == torch.float32 and DEV == "cuda":
        torch.testing.assert_close(got.scale, s_ref, rtol=1e-6, atol=0)
        err = (got.q.float() * got.scale - want_values).abs()
        assert (err <= want_values.abs() / 16 + s_ref / 512).all()
        return
    assert torch.equal(got.scale, s_ref)
    assert torch.equal(got.q.float(), q_ref.float())  # the interpreter may drop -0's sign


@pytest.mark.parametrize("d", [64, 576, pytest.param(4096, marks=CUDA_ONLY)])
@pytest.mark.parametrize("num_tokens", [1, 5, pytest.param(33, marks=CUDA_ONLY)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_out_is_the_unquantized_result_quantized(d, num_tokens, dtype):
    # The W8A8 input straight from the norm: the kernel's own unquantized result (checked
    # against the reference above), quantized per row as quantize_rows_fp8 does, bit for bit.
    x, residual, w = inputs(num_tokens, d, dtype, seed=5)
    x[0, 3] = 0.0
    same_fp8_rows(rms_norm_triton(x, w, 1e-6, quant="fp8"), rms_norm_triton(x, w, 1e-6))
    x2, r2 = x.clone(), residual.clone()
    rows, res = fused_add_rms_norm_triton(x, residual, w, 1e-6, quant="fp8")
    want, want_res = fused_add_rms_norm_triton(x2, r2, w, 1e-6)
    assert torch.equal(res, want_res) and res.data_ptr() == residual.data_ptr()
    same_fp8_rows(rows, want)


def test_fp8_out_of_a_zero_row_has_scale_one():
    x, residual, w = inputs(3, 64, torch.float32, seed=6)
    rows, _ = fused_add_rms_norm_triton(torch.zeros_like(x), torch.zeros_like(x), w, 1e-6,
                                        quant="fp8")
    assert torch.equal(rows.scale, torch.ones(3, 1, device=DEV))
    assert not rows.q.float().any()


def test_fp8_dispatch_on_cpu_is_the_reference():
    x, residual, w = torch.randn(3, 32), torch.randn(3, 32), torch.rand(32)
    same_fp8_rows(rms_norm(x, w, 1e-6, quant="fp8"), rms_norm_ref(x, w, 1e-6))
    want, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    rows, res = fused_add_rms_norm(x, residual, w, 1e-6, quant="fp8")
    same_fp8_rows(rows, want)
    assert torch.equal(res, want_res)


def same_int8_chunks(got, values: torch.Tensor) -> None:
    # got (Int8Chunks): bit for bit what the reference rounding makes of `values`
    want = int8_chunks_ref(values)
    assert got.dtype == values.dtype and got.cols == values.shape[1]
    assert torch.equal(got.words, want.words) and torch.equal(got.floats, want.floats)


@pytest.mark.parametrize("d", [40, 576, pytest.param(4096, marks=CUDA_ONLY)])
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_out_rounds_the_rows_it_writes(d, num_tokens, dtype):
    # The W4A8 input straight from the norm: with a residual the normed sum still goes over x
    # (as without `quant`) and is what gets rounded; without one, the rows match the plain
    # kernel's (exactly but for float32 on a GPU, where contraction into FMAs may differ).
    x, residual, w = inputs(num_tokens, d, dtype, seed=7)
    x2, r2 = x.clone(), residual.clone()
    chunks, res = fused_add_rms_norm_triton(x, residual, w, 1e-6, quant="int8")
    want, want_res = fused_add_rms_norm_triton(x2, r2, w, 1e-6)
    assert torch.equal(res, want_res) and res.data_ptr() == residual.data_ptr()
    same_int8_chunks(chunks, x)
    close(x, want)
    chunks = rms_norm_triton(want_res, w, 1e-6, quant="int8")
    plain = rms_norm_triton(want_res, w, 1e-6)
    if dtype == torch.float32 and DEV == "cuda":
        want = int8_chunks_ref(plain)
        torch.testing.assert_close(chunks.floats[..., 0], want.floats[..., 0], rtol=1e-5, atol=0)
        return
    same_int8_chunks(chunks, plain)


def test_int8_dispatch_on_cpu_is_the_reference():
    x, residual, w = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    same_int8_chunks(rms_norm(x, w, 1e-6, quant="int8"), rms_norm_ref(x, w, 1e-6))
    want, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    chunks, res = fused_add_rms_norm(x, residual, w, 1e-6, quant="int8")
    same_int8_chunks(chunks, want)
    assert torch.equal(res, want_res)
