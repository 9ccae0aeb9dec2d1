"""Group-wise integer weights on torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`:
bfloat16 activations, 4-bit codes unpacked in registers, W = (q - 8) * scale + zero with a
bf16 scale and zero per group of 32, 64, 128 or 256 input elements).

Weights given as unsigned codes with a float32 scale and offset per group (W = q * s + o: GGUF
blocks, skyline's INT4/INT8 layout with o = -zero * s) become one *plane* of the kernel when
the codes fit in 4 bits, and two when they are 5 to 8 bits wide: the low nibbles with scale s,
the high nibbles with 16 s, the two products added (10 bits a weight with groups of 32). The
offset goes with the plane whose values it does not cancel (each product is rounded to bf16
before they are added): an offset of the size of the high plane's range (-128 s: codes centred
on 128, as GGUF Q8_0) with the high plane, a small one with the low plane.

E2M1 (FP4) codes are not affine in their values, but twice their magnitudes (0, 1, 2, 3, 4, 6,
8, 12) are a + 8 b with a <= 6 and b <= 1: two planes again, signed codes 8 +- a with half the
block scale and 8 +- b with four times it (`pack_e2m1_planes`, MXFP4's blocks of 32).

The kernel is compute-bound from a few rows on: two planes are faster than dense bf16 for one
or two rows on large Linears and about half its speed at eight (bench/gguf_cpu_planes.py).
"""

from __future__ import annotations

import torch

Plane = tuple[torch.Tensor, torch.Tensor]  # (packed codes, scales_and_zeros [G, N, 2] bf16)
GROUPS = (32, 64, 128, 256)  # group sizes the kernel takes


def has_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def pack_planes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                group: int, wide: bool) -> tuple[Plane, ...] | None:
    """codes [N, K] uint8 (0..15, or 0..255 with `wide`), scale and offset [N, K / group]
    float32 -> the kernel's planes; None where the kernel cannot take the shape (N not a
    multiple of 16, K not whole groups, a group size it lacks)."""
    if not _fits(codes, scale, group):
        return None
    if not wide:
        planes = [(codes, scale, offset + 8 * scale)]
    else:
        s_b = scale.to(torch.bfloat16).float()  # zeros from the scale the kernel multiplies by
        high = offset.abs() >= 64 * scale.abs()
        planes = [(codes & 0x0F, s_b, torch.where(high, 8 * s_b, offset + 8 * s_b)),
                  (codes >> 4, 16 * s_b, torch.where(high, offset + 128 * s_b, 128 * s_b))]
    return tuple(_plane(q, s, zero) for q, s, zero in planes)


def pack_e2m1_planes(codes: torch.Tensor, scale: torch.Tensor, group: int
                     ) -> tuple[Plane, ...] | None:
    """E2M1 codes [N, K] uint8 (bit 3 the sign, bits 0-2 the magnitude index) with a float32
    scale per block [N, K / group] -> two planes whose sum is exactly code value x scale (the
    scales must be exact in bf16, as MXFP4's powers of two are); None as pack_planes."""
    if not _fits(codes, scale, group):
        return None
    twice = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.int32)[(codes & 7).long()]
    b = (twice >= 8).to(torch.int32)
    sign = 1 - 2 * (codes >> 3).to(torch.int32)
    zero = torch.zeros_like(scale)
    return (_plane(8 + sign * (twice - 8 * b), scale / 2, zero),
            _plane(8 + sign * b, scale * 4, zero))


def _fits(codes: torch.Tensor, scale: torch.Tensor, group: int) -> bool:
    # the shapes the kernel takes: rows a multiple of 16, whole groups of a size it has
    n, k = codes.shape
    return group in GROUPS and not n % 16 and not k % group and scale.shape == (n, k // group)


def _plane(q: torch.Tensor, s: torch.Tensor, zero: torch.Tensor) -> Plane:
    # codes q [N, K] (0..15) with W = (q - 8) * s + zero, s and zero [N, K / group]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return packed, torch.stack([s.t(), zero.t()], -1).to(torch.bfloat16).contiguous()


def planes_mm(x: torch.Tensor, planes: tuple[Plane, ...], group: int = 0) -> torch.Tensor:
    """x [M, K] bfloat16 -> [M, N] bfloat16: the sum of the planes' products (`group`: the
    planes' group size, where the caller knows it)."""
    group = group or planes_group(planes)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, planes[0][0], group, planes[0][1])
    for packed, sz in planes[1:]:
        y = y + torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)
    return y


def planes_linear(x: torch.Tensor, planes: tuple[Plane, ...],
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K'] (K' <= K: the weights' padding columns meet zeros) -> [..., N] in x's
    dtype, through bfloat16."""
    # (each operation, and each Python call, skipped when it would be a no-op: a CPU decode
    # step is bound by what Python dispatches)
    packed, sz = planes[0]
    k = packed.numel() * 2 // sz.shape[1]  # planes_cols, inline
    group = k // sz.shape[0]
    if x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[1] == k and bias is None:
        return planes_mm(x, planes, group)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.bfloat16:
        x2 = x2.to(torch.bfloat16)
    if x2.shape[1] < k:
        x2 = torch.nn.functional.pad(x2, (0, k - x2.shape[1]))
    y = planes_mm(x2, planes, group)
    if x.dtype != torch.bfloat16:
        y = y.to(x.dtype)
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias.to(y.dtype)


def planes_weight(planes: tuple[Plane, ...], chunk: int = 1024) -> torch.Tensor:
    """The float32 weights [N, K] the planes multiply by: the kernel applied to rows of the
    identity (each output one weight times 1: exact but for the bf16 output), `chunk` rows at
    a time."""
    k, group = planes_cols(planes), planes_group(planes)
    parts = []
    for k0 in range(0, k, chunk):
        cols = torch.arange(k0, min(k0 + chunk, k))
        eye = torch.zeros(len(cols), k, dtype=torch.bfloat16)
        eye[torch.arange(len(cols)), cols] = 1
        parts.append(sum(torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, packed, group, sz).float() for packed, sz in planes))
    return torch.cat(parts).t()


def planes_cols(planes: tuple[Plane, ...]) -> int:
    """K, the input columns the planes take (the packed codes are N x K / 2 bytes)."""
    packed, sz = planes[0]
    return packed.numel() * 2 // sz.shape[1]


def planes_group(planes: tuple[Plane, ...]) -> int:
    """The planes' group size."""
    return planes_cols(planes) // planes[0][1].shape[0]
