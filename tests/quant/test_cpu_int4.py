"""ops/cpu_int4.py: integer weights on torch's CPU int4 kernel, one plane (4-bit codes) or two
(5- to 8-bit codes), and skyline's own INT4 / INT8 Linears on it in bfloat16: the products
match the weights the codes stand for within bf16 rounding; shapes the kernel cannot take fall
back to the exact path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from skyline.ops import cpu_int4
from skyline.quant.intq import IntLinearMethod

pytestmark = pytest.mark.skipif(not cpu_int4.has_kernel(), reason="torch lacks the CPU int4 kernel")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("wide,group", [(False, 32), (False, 128), (True, 32), (True, 64)])
def test_planes_reproduce_codes_times_scale_plus_offset(wide, group):
    g = torch.Generator().manual_seed(group + wide)
    n, k = 48, 512
    codes = torch.randint(0, 256 if wide else 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    # offsets both ways: small (low plane) and about -128 s (high plane)
    offset = torch.where(torch.rand(n, k // group, generator=g) < 0.5, -128 * scale,
                         torch.randn(n, k // group, generator=g) * 0.05)
    w = codes.float() * scale.repeat_interleave(group, 1) + offset.repeat_interleave(group, 1)
    planes = cpu_int4.pack_planes(codes, scale, offset, group, wide)
    assert planes is not None and len(planes) == (2 if wide else 1)
    assert rel(cpu_int4.planes_weight(planes), w) < 1e-2
    x = torch.randn(5, k)
    y = cpu_int4.planes_linear(x.to(torch.bfloat16), planes)
    assert y.dtype == torch.bfloat16 and rel(y, x.to(torch.bfloat16).float() @ w.T) < 2e-2
    y32 = cpu_int4.planes_linear(x[:, : k - 7], planes)  # fewer columns: padded with zeros
    assert y32.dtype == torch.float32
    assert rel(y32, x[:, : k - 7].to(torch.bfloat16).float() @ w[:, : k - 7].T) < 2e-2


def test_shapes_the_kernel_cannot_take():
    codes = torch.zeros(24, 64, dtype=torch.uint8)  # 24 rows: not a multiple of 16
    s = torch.ones(24, 2)
    assert cpu_int4.pack_planes(codes, s, s, 32, False) is None
    codes = torch.zeros(32, 96, dtype=torch.uint8)
    assert cpu_int4.pack_planes(codes, torch.ones(32, 6), torch.ones(32, 6), 16, False) is None


@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 128)])
def test_int_linear_in_bfloat16_runs_the_kernel(bits, group):
    g = torch.Generator().manual_seed(bits + group)
    w = torch.randn(64, 200, generator=g) * 0.05  # 200 columns: padded to whole groups
    b = torch.randn(64, generator=g)
    method = IntLinearMethod(SimpleNamespace(group_size=group, prequantized=False, layout=None),
                             bits)
    layer = SimpleNamespace(bias=b, **method.quantize(w))
    wq = method.dequantize({k: getattr(layer, k) for k in ("qweight", "scales", "zeros")}, 200)
    x = torch.randn(3, 200, generator=g)
    exact = method.apply(layer, x)  # float32: the reference path, no planes
    torch.testing.assert_close(exact, F.linear(x, wq, b), rtol=1e-4, atol=1e-4)
    assert not hasattr(layer, "int_planes")
    y = method.apply(layer, x.to(torch.bfloat16))
    assert len(layer.int_planes) == (1 if bits == 4 else 2)
    assert y.dtype == torch.bfloat16
    assert rel(y, F.linear(x.to(torch.bfloat16).float(), wq, b)) < 2e-2


@pytest.mark.parametrize("k", [32, 96])
def test_e2m1_planes_are_exact(k):
    from skyline.quant.fp4 import decode_e2m1

    g = torch.Generator().manual_seed(k)
    n = 32
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code
    scale = torch.exp2(torch.randint(-20, 4, (n, k // 32), generator=g).float())  # E8M0 values
    planes = cpu_int4.pack_e2m1_planes(codes, scale, 32)
    assert planes is not None and len(planes) == 2
    want = decode_e2m1(codes) * scale.repeat_interleave(32, 1)
    assert torch.equal(cpu_int4.planes_weight(planes), want)
    assert cpu_int4.pack_e2m1_planes(codes[:24], scale[:24], 32) is None  # rows not 16k
    assert cpu_int4.pack_e2m1_planes(codes, scale, 16) is None  # blocks the kernel lacks
