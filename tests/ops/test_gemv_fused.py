"""The GEMV that forms its input on the way in: silu(gate) * up (bit-identical to the GEMV of
silu_and_mul's output, the same rounding) and RMSNorm of x + residual (against the norm
kernel's reference, and the residual sums stored exactly); and the model layers that use them
give the unfused results. Triton's interpreter on CPU, the GPU where there is one."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from skyline.ops.activation import silu_and_mul_triton  # noqa: E402
from skyline.ops.gemv import AddRmsNorm, gemv, gemv_ref  # noqa: E402
from skyline.ops.norm import fused_add_rms_norm_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
CONFIGS = [  # tensor cores, K split or not, K a multiple of the tile or not
    {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "USE_DOT": True},
    {"BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "USE_DOT": True},
    {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 3, "USE_DOT": True},
]
FMA = {"BLOCK_N": 4, "BLOCK_K": 64, "SPLIT_K": 1, "USE_DOT": False}


def cfg(c: dict) -> dict:
    return {**c, "num_warps": 4, "num_stages": 2}


def rand(*shape, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 33, 200), (8, 64, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_mul_input_is_the_activation_kernel(dtype, c, m, n, k, bias):
    gate_up = rand(m, 2 * k, seed=m + k, dtype=dtype, scale=2.0)
    w = rand(n, k, seed=n, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=1, dtype=dtype) if bias else None
    fused = gemv(gate_up, w, b, config=cfg(c), silu_mul=True)
    unfused = gemv(silu_and_mul_triton(gate_up), w, b, config=cfg(c))
    if dtype == torch.float32:  # compiled float32 math may contract differently; 16-bit
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)  # inputs round alike
    else:
        assert torch.equal(fused, unfused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", CONFIGS)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 33, 200), (8, 64, 256)])
def test_add_norm_input_is_the_norm(dtype, c, m, n, k):
    x = rand(m, k, seed=k, dtype=dtype)
    res = rand(m, k, seed=k + 1, dtype=dtype, scale=4.0)
    g = rand(k, seed=2, dtype=dtype).abs() + 0.5
    w = rand(n, k, seed=n, dtype=dtype, scale=k**-0.5)
    b = rand(n, seed=3, dtype=dtype)
    res_out = torch.full_like(x, float("nan"))
    x0, res0 = x.clone(), res.clone()
    y = gemv(x, w, b, config=cfg(c), add_norm=AddRmsNorm(res, g, 1e-6, res_out))
    h, want_res = fused_add_rms_norm_ref(x0, res0, g, 1e-6)
    assert torch.equal(res_out, want_res)  # every column, by the first program along N
    assert torch.equal(x, x0) and torch.equal(res, res0)
    # Normalized in float32 and scaled at the end: within the reference's own bf16 rounding.
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(y.float(), gemv_ref(h, w, b).float(), rtol=tol, atol=tol)


def test_add_norm_rejects_mismatched_buffers():
    x = rand(2, 64, seed=0, dtype=torch.float32)
    w = rand(8, 64, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="add_norm"):
        gemv(x, w, add_norm=AddRmsNorm(x[:1], torch.ones(64, device=DEV), 1e-6, x.clone()))
    with pytest.raises(ValueError, match="does not match"):
        gemv(x, w, silu_mul=True)  # x must have 2K columns
    with pytest.raises(ValueError, match="need USE_DOT"):
        gemv(torch.cat([x, x], 1), w, config=cfg(FMA), silu_mul=True)


@pytest.mark.skipif(DEV != "cuda", reason="the layers take the fused GEMV on CUDA only")
@pytest.mark.parametrize("m", [1, 3, 8])
def test_layers_fused_and_unfused_agree(m):
    from skyline.model.layers.linear import Linear
    from skyline.model.layers.mlp import MLP
    from skyline.model.layers.norm import RMSNorm

    torch.manual_seed(0)
    with torch.device(DEV):
        mlp = MLP(1024, 2816).to(torch.bfloat16)
        qkv = Linear(1024, 1536).to(torch.bfloat16)
        norm = RMSNorm(1024).to(torch.bfloat16)
    for p in [*mlp.parameters(), *qkv.parameters()]:
        p.data.normal_(0, 0.03)
    norm.weight.data.uniform_(0.5, 1.5)
    x, res = rand(m, 1024, seed=m, dtype=torch.bfloat16), rand(m, 1024, seed=9,
                                                               dtype=torch.bfloat16)
    y, new_res = qkv.forward_add_norm(x.clone(), res.clone(), norm)
    h, want_res = norm(x.clone(), res.clone())
    assert torch.equal(new_res, want_res)
    torch.testing.assert_close(y, qkv(h), rtol=2e-2, atol=2e-2)
    gate_up = mlp.gate_up_proj(h)
    assert torch.equal(mlp.down(gate_up), mlp.down_proj(silu_and_mul_triton(gate_up)))
