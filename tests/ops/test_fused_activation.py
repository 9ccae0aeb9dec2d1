"""The Triton SiLU-and-mul and gpt-oss SwiGLU kernels against their PyTorch references over
widths, token counts and dtypes. Runs on CUDA, or in Triton's interpreter on CPU (small sizes;
see tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.ops import activation  # noqa: E402
from skyline.ops.activation import (  # noqa: E402
    silu_and_mul,
    silu_and_mul_fp8_triton,
    silu_and_mul_int8_triton,
    silu_and_mul_ref,
    silu_and_mul_triton,
    swiglu_oai,
    swiglu_oai_ref,
    swiglu_oai_triton,
)
from skyline.ops.fp8_quant import FP8, quantize_rows_fp8_ref  # noqa: E402
from skyline.ops.gemv import MAX_ROWS  # noqa: E402
from skyline.ops.gemv_int_a8 import int8_chunks_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(DEV == "cpu", reason="large sweep: CUDA only")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# CPU: Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# intermediate sizes: small, not a multiple of the block, SmolLM2's 1536, Qwen3-8B's, Llama-3's
WIDTHS = [64, 200, 1536] + [pytest.param(d, marks=CUDA_ONLY) for d in (12288, 14336)]
TOKENS = [1, 7, 33] + [pytest.param(n, marks=CUDA_ONLY) for n in (100, 1000)]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def gate_up(num_tokens: int, d: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + num_tokens * 13 + d)
    return (torch.randn(num_tokens, 2 * d, generator=g) * 3).to(DEV, dtype)


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(d, num_tokens, dtype):
    x = gate_up(num_tokens, d, dtype)
    close(silu_and_mul_triton(x), silu_and_mul_ref(x))


@pytest.mark.parametrize("config", [{"BLOCK": 64, "num_warps": 1}, {"BLOCK": 256, "num_warps": 2},
                                    {"BLOCK": 4096, "num_warps": 8}])
def test_launch_configs_agree(config):
    x = gate_up(5, 300, torch.float32, seed=1)
    close(silu_and_mul_triton(x, config), silu_and_mul_ref(x))


def test_strided_rows():
    # rows of a wider buffer (a view with row stride > 2 * d)
    wide = gate_up(6, 80, torch.float32, seed=2)
    x = wide[:, :100]
    assert not x.is_contiguous()
    close(silu_and_mul_triton(x), silu_and_mul_ref(x))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
def test_extremes_stay_finite():
    # silu(-large) is -0 (exp overflows to inf, by design), silu(+large) the input itself
    x = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, 2.0, 2.0, 2.0, 2.0, 2.0]], device=DEV)
    got = silu_and_mul_triton(x)
    assert torch.isfinite(got).all()
    close(got, silu_and_mul_ref(x))


def test_dispatch_on_cpu_is_the_reference():
    x = torch.randn(3, 2, 16)  # any leading dims
    assert torch.equal(silu_and_mul(x), silu_and_mul_ref(x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dispatch_on_cuda_graph_safe():
    x = gate_up(16, 14336, torch.bfloat16, seed=3)
    close(silu_and_mul(x), silu_and_mul_ref(x))
    static = torch.zeros_like(x)
    silu_and_mul(static)  # warm-up (compilation) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(static)
    x2 = gate_up(16, 14336, torch.bfloat16, seed=4)
    static.copy_(x2)
    graph.replay()
    close(out, silu_and_mul_ref(x2))


@pytest.mark.parametrize("d", [64, 200, 1536, pytest.param(14336, marks=CUDA_ONLY)])
@pytest.mark.parametrize("num_tokens", [1, 3, 9, pytest.param(33, marks=CUDA_ONLY)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 128])  # blocks past d, or several per row
def test_fp8_out_is_the_unquantized_result_quantized(d, num_tokens, dtype, block, monkeypatch):
    # The W8A8 input of the down projection straight from the activation kernel: the kernel's
    # own unquantized result, quantized per row and block as quantize_rows_fp8_ref does (the
    # fp8 GEMV's batches, up to MAX_ROWS rows), or per row for torch._scaled_mm (9, 33 rows).
    if block is not None:
        monkeypatch.setattr(activation, "FP8_BLOCK", block)
    x = gate_up(num_tokens, d, dtype, seed=5)
    x[0, :3] = 0.0  # zeros keep their sign, whatever the interpreter does to -0
    rows = silu_and_mul_fp8_triton(x)
    want_block = activation.FP8_BLOCK if num_tokens <= MAX_ROWS else 0
    q_ref, s_ref = quantize_rows_fp8_ref(silu_and_mul_triton(x), want_block)
    assert rows.dtype == dtype and rows.q.dtype == FP8 and rows.q.shape == (num_tokens, d)
    assert rows.block == want_block and rows.scale.shape == s_ref.shape
    assert torch.equal(rows.scale, s_ref)
    assert torch.equal(rows.q.float(), q_ref.float())  # the interpreter may drop -0's sign


def test_fp8_out_of_rows_wider_than_a_program_holds(monkeypatch):
    # one scale per row of more than WHOLE_ROW columns: the plain kernel, then the quantizer
    monkeypatch.setattr(activation, "WHOLE_ROW", 128)
    x = gate_up(MAX_ROWS + 1, 200, torch.float32, seed=6)
    rows = silu_and_mul_fp8_triton(x)
    q_ref, s_ref = quantize_rows_fp8_ref(silu_and_mul_triton(x))
    assert rows.block == 0 and torch.equal(rows.scale, s_ref)
    assert torch.equal(rows.q.float(), q_ref.float())


def test_fp8_dispatch_on_cpu_is_the_reference():
    x = torch.randn(3, 32)
    rows = silu_and_mul(x, quant="fp8")
    q_ref, s_ref = quantize_rows_fp8_ref(silu_and_mul_ref(x), activation.FP8_BLOCK)
    assert torch.equal(rows.scale, s_ref) and torch.equal(rows.q.float(), q_ref.float())


@pytest.mark.parametrize("d,num_tokens", [(64, 1), (1000, 2), (2100, 2),
                                          pytest.param(14336, 3, marks=CUDA_ONLY)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_out_rounds_the_unquantized_result(d, num_tokens, dtype):
    # The W4A8 input straight from the activation: its own result in the dtype (programs of
    # 1,024 columns, a part-filled last chunk), rounded as int8_chunks_ref rounds it.
    x = gate_up(num_tokens, d, dtype, seed=8)
    got, want = silu_and_mul_int8_triton(x), int8_chunks_ref(silu_and_mul_triton(x))
    assert got.dtype == dtype and got.cols == d
    assert torch.equal(got.words, want.words) and torch.equal(got.floats, want.floats)


def test_int8_dispatch_on_cpu_is_the_reference():
    x = torch.randn(3, 64)
    got, want = silu_and_mul(x, quant="int8"), int8_chunks_ref(silu_and_mul_ref(x))
    assert torch.equal(got.words, want.words) and torch.equal(got.floats, want.floats)


@pytest.mark.parametrize("d", [64, 200, 2880])
@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [None, 7.0, 0.7])
def test_swiglu_oai_matches_reference(d, num_tokens, dtype, limit):
    # limit 0.7 is not a bfloat16: the clamped values round as torch's clamp rounds them. Five
    # roundings in a row: on the CPU, whose interpreter truncates them, up to a few ulps apart
    x = gate_up(num_tokens, d, dtype, seed=3)
    got, want = swiglu_oai_triton(x, limit, block=256), swiglu_oai_ref(x, limit)
    tol = TOL[dtype] * (2 if DEV == "cpu" and dtype != torch.float32 else 1)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_swiglu_oai_clamps():
    # every gate above the limit and up outside it: the clamp decides the result
    x = torch.tensor([[10.0, -3.0, 20.0, -20.0]], device=DEV)  # gate 10, -3; up 20, -20
    got = swiglu_oai_triton(x, 7.0)
    gate, up = torch.tensor([7.0, -3.0]), torch.tensor([7.0, -7.0])
    want = gate * torch.sigmoid(1.702 * gate) * (up + 1)
    torch.testing.assert_close(got.cpu(), want[None], atol=1e-5, rtol=1e-5)


def test_swiglu_oai_dispatch_and_unfuse(monkeypatch):
    """The kernel on CUDA, the reference elsewhere and under SKYLINE_UNFUSE=silu."""
    import dataclasses

    from skyline import envs

    calls = []
    monkeypatch.setattr(activation, "swiglu_oai_triton",
                        lambda *a: calls.append(1) or swiglu_oai_triton(*a))
    x = gate_up(3, 64, torch.float32, seed=4)
    close(swiglu_oai(x, 7.0), swiglu_oai_ref(x, 7.0))
    assert len(calls) == (DEV == "cuda")
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, unfuse=frozenset({"silu"})))
    assert torch.equal(swiglu_oai(x, 7.0), swiglu_oai_ref(x, 7.0))
    assert len(calls) == (DEV == "cuda")
