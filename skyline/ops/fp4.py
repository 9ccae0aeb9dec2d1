"""E2M1 (FP4) codes and MXFP4 blocks read back to floats: the references the FP4 weight formats
(quant/fp4.py) and the MoE kernels (ops/moe.py) share.

E2M1 codes: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Two
codes per byte, element 2j in the low nibble. MXFP4 (OCP Microscaling v1.0): blocks of 32
elements, one E8M0 scale per block, 2^(e - 127) (e = 255 is NaN). NVFP4: blocks of 16, an E4M3
scale per block and a float32 scale per tensor (per row in a merged layer).
"""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, 2n] uint8 codes < 16 -> [rows, n] bytes: element 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[rows, n] bytes -> [rows, 2n] uint8 codes (inverse of pack_nibbles)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> float32 values. Arithmetic, not a table lookup, so it creates no
    tensor from Python values (CUDA-graph capturable)."""
    c = code.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, m * 0.5, torch.exp2((e - 1).float()) * (1.0 + m * 0.5))
    return torch.where((c & 8) != 0, -mag, mag)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 2^(e - 127) (255 -> NaN)."""
    v = torch.exp2(e.float() - 127.0)
    return torch.where(e == 255, torch.full_like(v, float("nan")), v)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [R, Kp / 2] and E8M0 scales uint8 [R, Kp / 32] -> float32 [R, Kp]."""
    rows = packed.shape[0]
    vals = decode_e2m1(unpack_nibbles(packed)).reshape(rows, -1, 32)
    return (vals * e8m0_to_float(scales).unsqueeze(-1)).reshape(rows, -1)


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor
) -> torch.Tensor:
    """NVFP4 codes uint8 [R, Kp / 2], E4M3 block scales [R, Kp / 16] and tensor_scale [1] or
    per row [R] -> float32 [R, Kp]."""
    rows = packed.shape[0]
    vals = decode_e2m1(unpack_nibbles(packed)).reshape(rows, -1, 16)
    step = scales.float() * tensor_scale.float().reshape(-1, 1)  # [R, B]
    return (vals * step.unsqueeze(-1)).reshape(rows, -1)
