"""Weight-only INT8 / INT4 matmul with group-wise asymmetric scales: y = x W^T where
W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group].

Layout (rows = output features, padded input dim Kp = num_groups * group):
  qweight: uint8 [N, Kp] (8 bits) or [N, Kp / 2] (4 bits: element 2j in the low nibble of
  byte j, element 2j + 1 in the high nibble); scales: float32 [N, num_groups];
  zeros: uint8 [N, num_groups] (or float32: GGUF blocks with an arbitrary offset per group).

`int_matmul_ref` dequantizes and runs one torch matmul; `int_matmul_triton` dequantizes
tile by tile inside the matmul, so the full-precision weight never exists in memory.
"""

from __future__ import annotations

import torch

from skyline.ops.triton_utils import tl, triton


def dequantize_int_ref(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int
) -> torch.Tensor:
    """[N, Kp] float32 weight from the packed tensors (columns past K are padding)."""
    if bits == 4:
        q = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).flatten(-2)  # [N, Kp]
    else:
        q = qweight
    n = q.shape[0]
    q = q.float().reshape(n, -1, group)  # [N, num_groups, group]
    w = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.reshape(n, -1)


def int_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group: int,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype."""
    k = x.shape[-1]
    w = dequantize_int_ref(qweight, scales, zeros, bits, group)[:, :k]
    return torch.matmul(x, w.to(x.dtype).t())


if triton is not None:

    @triton.jit
    def _int_matmul_kernel(
        x_ptr, q_ptr, s_ptr, z_ptr, y_ptr,
        M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
        GROUP: tl.constexpr, BITS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k0 = 0
        while k0 < K:  # a while loop: Triton's interpreter cannot run range() to a runtime bound
            k = k0 + offs_k
            k_mask = k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w_mask = k_mask[:, None] & n_mask[None, :]
            if BITS == 8:
                q = tl.load(q_ptr + offs_n[None, :] * stride_qn + k[:, None], mask=w_mask, other=0)
            else:
                b = tl.load(q_ptr + offs_n[None, :] * stride_qn + (k // 2)[:, None], mask=w_mask,
                            other=0)
                q = (b >> ((k % 2) * 4)[:, None].to(tl.uint8)) & 0x0F  # [BLOCK_K, BLOCK_N]
            # BLOCK_K divides GROUP, so the whole tile shares one group per output row.
            g = k0 // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
            w = (q.to(tl.float32) - z[None, :]) * s[None, :]
            if IEEE:  # fp32 activations: exact fp32, not the tensor cores' tf32
                acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
            k0 += BLOCK_K
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y,
                 mask=m_mask[:, None] & n_mask[None, :])


def int_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    bits: int, group: int,
) -> torch.Tensor:
    """Same contract as int_matmul_ref; block sizes are untuned (to be autotuned on GPU)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    m, n = x2.shape[0], qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, min(group, 64)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_matmul_kernel[grid](
        x2, qweight, scales, zeros, y, m, n, k,
        x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        GROUP=group, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x2.dtype == torch.float32,
    )
    return y.reshape(*lead, n)
