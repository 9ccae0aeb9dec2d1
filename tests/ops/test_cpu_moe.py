"""The C++ mixture-of-experts MLP on the integer dot kernel (csrc/cpu_moe.cpp) against its
Python form (ops/cpu_moe.py's moe_intdot_ref), bit for bit, and against the kernel's numerical
reference."""

from __future__ import annotations

import pytest
import torch

from skyline.ops import cpu_intdot, cpu_moe
from skyline.ops.moe import moe_activation_ref, moe_by_expert

pytestmark = pytest.mark.skipif(not cpu_intdot.available(),
                                reason="the CPU extension does not build here")

E, H, INTER = 6, 64, 96


def _experts(bits13: int, bits2: int, group: int, rounds: int, seed: int = 0):
    """Stacked weights [E, N, ...] of random codes of `bits` (as quant/gguf_experts.py packs
    every expert's rows in one call)."""
    g = torch.Generator().manual_seed(seed)

    def stacked(n: int, k: int, bits: int) -> cpu_intdot.IntDotWeight:
        codes = torch.randint(0, 2**bits, (E * n, k), generator=g, dtype=torch.uint8)
        codes[0, 0] = 2**bits - 1
        scale = torch.rand(E * n, k // group, generator=g) * 0.02 + 0.001
        offset = -torch.rand(E * n, k // group, generator=g) * 0.1
        w = cpu_intdot.pack(codes, scale, offset, group, rounds)
        assert w is not None and w.bits == bits
        return w._replace(**{f: getattr(w, f).view(E, n, -1)
                             for f in ("codes", "scale", "offset")})

    return stacked(2 * INTER, H, bits13), stacked(H, INTER, bits2)


def _routing(t: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits13,bits2,group,rounds",
                         [(4, 8, 32, 1), (4, 6, 32, 2), (8, 8, 16, 1), (6, 4, 16, 2)])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_cpp_equals_python_bit_for_bit(dtype, bits13, bits2, group, rounds, t):
    w13, w2 = _experts(bits13, bits2, group, rounds)
    x = (torch.randn(t, H, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
    weights, ids = _routing(t, 2)
    got = cpu_moe.moe_intdot(x, weights, ids, w13, w2)
    assert got.dtype == dtype and got.shape == (t, H)
    assert torch.equal(got, cpu_moe.moe_intdot_ref(x, weights, ids, w13, w2))


def test_against_the_kernels_reference_and_an_expert_map():
    """Experts 4 and 5 held by another rank (map -1): their pairs contribute nothing, as
    pairs of weight 0 do."""
    w13, w2 = _experts(4, 8, 32, 2)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3))
    weights, ids = _routing(9, 3)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1])

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = moe_activation_ref(cpu_intdot.intdot_mm_ref(rows, cpu_moe.expert(w13, e)), "silu")
        return cpu_intdot.intdot_mm_ref(h, cpu_moe.expert(w2, e))

    want = moe_by_expert(x, weights, ids, E, mlp, expert_map)
    got = cpu_moe.moe_intdot(x, weights, ids, w13, w2, expert_map=expert_map)
    # float32 sums against float64: a last bit of gate-and-up may flip an int8 rounding of
    # the activations before down
    assert ((got - want).norm() / want.norm()).item() < 1e-3
    held = ids < 4
    assert torch.equal(cpu_moe.moe_intdot(x, weights * held, ids, w13, w2), got)


def test_bad_expert_ids_are_an_error():
    w13, w2 = _experts(4, 8, 32, 1)
    x = torch.randn(2, H)
    with pytest.raises(RuntimeError, match="expert id 6 of 6"):
        cpu_moe.moe_intdot(x, torch.ones(2, 1), torch.tensor([[1], [6]]), w13, w2)
