"""Integer dot products on the CPU: GGUF-style weights (unsigned 4-, 6- or 8-bit codes with a
scale and offset per group of 16 or 32: fp16, or as GGUF's K types hold them, an int8 per group
times a factor per 256 elements) times activations rounded to int8 per 32 elements, as
llama.cpp's CPU kernels compute a quantized matmul.

torch has no such kernel: its int4 kernel (ops/cpu_int4.py) takes bfloat16 activations and
unpacks the codes to floats, at about half of a CPU's read rate on one row, and its int8
products take one activation scale per row, which costs SmolLM2 a KL of 0.057. Here one
unsigned-by-signed byte dot product (`vpdpbusd` with AVX-512 VNNI or AVX-VNNI, `vpmaddubsw` on
AVX2) covers 32 weights, reading 5-6 bits a weight for 4-bit codes with fp16 scales (4.75 with a
K type's: Q4_K), 7-8 for 6-bit codes (5- and 6-bit GGUF types: Q5_0, Q5_1, Q5_K, Q6_K; 6.75-7.25
with a K type's) and 9-10 for 8-bit codes, and every row of a decode batch reuses each group it
loads.

The C++ is csrc/cpu_intdot.cpp, built for this machine by ops/cpu_ext.py; where it does not
build, `available()` is False and the callers keep torch's kernels.

Rounding the activations is the one approximation: x1 = d * nearbyint(x / d), d = max|x| / 127
per 32 elements (llama.cpp's: an error of ~1/254 of a block's largest element, which costs the
default model's 8-bit files about as much again as bfloat16 does), or, with two rounds (a
weight's `rounds`, the CPU plan's choice), x^ = x1 + x2 with x2 the same rounding of x - x1
(`quantize_activations_ref`): two int8 products a row that share each weight load, the error
~1/254 of one round's, below bfloat16's, for twice the multiplications (which bound the kernel
where the CPU lacks VNNI). The products are exact integers and the sums float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from skyline.ops import cpu_ext

BLOCK = 32  # activation elements per int8 scale
GROUPS = (16, 32)  # weight elements per scale and offset
SUPER = 256  # elements per factor of the int8 scales (IntDotWeight.scale)


class IntDotWeight(NamedTuple):
    """A weight [N, K] for intdot_mm: W = codes * scale + offset per group."""

    codes: torch.Tensor  # uint8 [N, K / 2] (bits 4: element j of a block of 32 in byte j's
    #   low nibble, element j + 16 in its high one), [N, 3 K / 4] (bits 6: per 128 elements as
    #   GGUF's Q6_K, 64 bytes of low nibbles, byte j < 32 holding elements j and 64 + j, byte
    #   32 + j elements 32 + j and 96 + j, then 32 bytes whose byte j's bits 2i, 2i + 1 are the
    #   top two of element 32 i + j; the last K % 128 elements per block of 32, 16 bytes of low
    #   nibbles as bits 4, then 8 bytes whose byte j's bits 2i, 2i + 1 are element j + 8 i's
    #   top two) or [N, K] (bits 8)
    # scale and offset of each group: float16 [N, K / group], or per super-block of 256
    # elements (K whole super-blocks), as GGUF's K types hold them: int8 [N, K / group + K / 64],
    # an integer per group, then the row's factors (one per super-block, a float16's value) as
    # float32 bytes; a group's scale = factor * integer (exact in float32)
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    group: int
    rounds: int = 2  # times the activations are rounded to int8 (1 or 2; module docstring)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 8 // self.bits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int,
         rounds: int = 2) -> IntDotWeight | None:
    """codes [N, K] uint8 (0..255), scale and offset [N, K / group] float -> the kernel's layout
    (4 or 6 bits where every code fits), to be multiplied by activations rounded `rounds` times;
    None where the kernel cannot take it (K not whole blocks of 32, a group it lacks, or a
    scale or offset out of float16's range) or the kernel is not built here."""
    if rounds not in (1, 2):
        raise ValueError(f"rounds must be 1 or 2, got {rounds}")
    n, k = codes.shape
    if not available() or group not in GROUPS or k % BLOCK or scale.shape != (n, k // group):
        return None
    s16, o16 = scale.to(torch.float16), offset.to(torch.float16)
    if not (torch.isfinite(s16).all() and torch.isfinite(o16).all()):
        return None
    top = int(codes.max())
    bits = 4 if top < 16 else 6 if top < 64 else 8
    return IntDotWeight(layout(codes.to(torch.uint8), bits), s16.contiguous(),
                        o16.contiguous(), bits, group, rounds)


def pack_super(codes: torch.Tensor, scale: torch.Tensor, scale_d: torch.Tensor,
               offset: torch.Tensor, offset_d: torch.Tensor, group: int, rounds: int = 2
               ) -> IntDotWeight | None:
    """pack's weight with each group's scale and offset as an integer (int8 range) per group,
    scale and offset [N, K / group], times a factor per 256 elements, scale_d and offset_d
    [N, K / 256] (float, exact in float16): the layout of IntDotWeight.scale's second kind, a
    K-type GGUF tensor's scales as the file holds them (dequant.super_groups); None as pack,
    or where K is not whole super-blocks, an integer is out of range or a factor is not a
    float16."""
    n, k = codes.shape
    if k % SUPER or scale_d.shape != (n, k // SUPER) or offset_d.shape != scale_d.shape:
        return None
    ints = torch.stack((scale, offset))
    factors = torch.stack((scale_d, offset_d)).float()
    if int(ints.min()) < -128 or int(ints.max()) > 127 or not torch.equal(
            factors.to(torch.float16).float(), factors):
        return None
    w = pack(codes, scale.float(), offset.float(), group, rounds)
    if w is None:
        return None

    def compact(i: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return torch.cat((i.to(torch.int8), f.contiguous().view(torch.int8)), 1).contiguous()

    return w._replace(scale=compact(scale, scale_d), offset=compact(offset, offset_d))


def group_scales(w: IntDotWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) [N, K / group] float32 of each group of a packed weight."""
    if w.scale.dtype == torch.float16:
        return w.scale.float(), w.offset.float()
    n, k = w.shape
    groups = k // w.group

    def expand(t: torch.Tensor) -> torch.Tensor:
        f = t[:, groups:].contiguous().view(torch.float32)
        return t[:, :groups].float() * f.repeat_interleave(SUPER // w.group, 1)

    return expand(w.scale), expand(w.offset)


def layout(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> IntDotWeight.codes of `bits`."""
    if bits == 8:
        return codes.contiguous()
    n, k = codes.shape
    if bits == 6:
        return torch.cat((_layout6_wide(codes[:, :k // WIDE6 * WIDE6]),
                          _layout6_blocks(codes[:, k // WIDE6 * WIDE6:])), 1).contiguous()
    return _nibbles(codes).reshape(n, k // 2).contiguous()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> [N, K / 32, 16]: byte j of a block holds its elements j, j + 16 (low 4
    bits of each)."""
    halves = (codes & 0x0F).reshape(codes.shape[0], -1, 2, BLOCK // 2)
    return halves[:, :, 0] | (halves[:, :, 1] << 4)


def _unnibble(b: torch.Tensor) -> torch.Tensor:
    """[N, blocks, 16] -> the low 4 bits of the blocks' codes [N, blocks, 32]."""
    return torch.stack((b & 0x0F, b >> 4), 2).reshape(b.shape[0], -1, BLOCK)


WIDE6 = 128  # elements a 6-bit row holds in Q6_K's order (96 bytes), before its last blocks


def _layout6_wide(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    c = codes.reshape(n, k // WIDE6, 4, BLOCK)  # element 32 i + j at [i, j]
    lo = c & 0x0F
    low = torch.cat((lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)), 2)
    top = c >> 4
    high = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return torch.cat((low, high), 2).reshape(n, k * 3 // 4)


def _layout6_blocks(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    top = (codes >> 4).reshape(n, -1, 4, 8)  # element j + 8 i of a block at [i, j]
    high = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return torch.cat((_nibbles(codes), high), 2).reshape(n, k * 3 // 4)


def quantize_weight(w: torch.Tensor, rounds: int = 2, bits: int = 8) -> IntDotWeight | None:
    """A dense weight [N, K] rounded per 32 elements; None as pack. bits 8: GGUF's Q8_0 (codes
    centred on 128, a float16 scale), the scale refitted to the codes (least squares): a Q8_0
    weight that was dequantized to bfloat16 comes back as the file's codes and scales, not
    rescaled by its largest element's bfloat16 rounding. bits 6: codes 0..63 from each block's
    minimum, a float16 scale and offset refitted to them (least squares), for a weight whose
    file stored 6 bits or fewer (a GGUF head in Q6_K: 7 bits a weight instead of 9)."""
    if bits not in (6, 8):
        raise ValueError(f"quantize_weight rounds to 6 or 8 bits, not {bits}")
    n, k = w.shape
    if k % BLOCK:
        return None
    wb = w.float().reshape(n, k // BLOCK, BLOCK)
    if bits == 6:
        lo, hi = wb.amin(-1), wb.amax(-1)
        s = (hi - lo) / 63
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        q = torch.round((wb - lo[..., None]) * inv[..., None]).clamp(0, 63)
        # w ~ s q + o by least squares over the block, both rounded to float16, then the codes
        # again for what was kept (a block of one value keeps s = 0, o = that value)
        qm, wm = q.mean(-1, keepdim=True), wb.mean(-1, keepdim=True)
        var = ((q - qm) ** 2).sum(-1)
        fit = ((q - qm) * (wb - wm)).sum(-1) / var.clamp_min(1e-12)
        s = torch.where(var > 0, fit, s).to(torch.float16).float()
        o = (wm[..., 0] - s * qm[..., 0]).to(torch.float16).float()
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        q = torch.round((wb - o[..., None]) * inv[..., None]).clamp(0, 63)
        return pack(q.reshape(n, k).to(torch.uint8), s, o, BLOCK, rounds)
    s = wb.abs().amax(-1) / 127
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(wb * inv[..., None]).clamp(-127, 127)
    qq = (q * q).sum(-1)
    s = torch.where(qq > 0, (wb * q).sum(-1) / qq.clamp_min(1), s).to(torch.float16).float()
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    q = torch.round(wb * inv[..., None]).clamp(-127, 127) + 128
    return pack(q.reshape(n, k).to(torch.uint8), s, -128 * s, BLOCK, rounds)


def unpack_codes(w: IntDotWeight) -> torch.Tensor:
    """The codes [N, K] uint8 a packed weight holds."""
    if w.bits == 8:
        return w.codes
    n, k = w.shape
    if w.bits == 6:
        wide = k // WIDE6 * WIDE6
        c = w.codes[:, :wide * 3 // 4].reshape(n, wide // WIDE6, 96)
        lo = torch.stack((c[..., :32] & 0x0F, c[..., 32:64] & 0x0F, c[..., :32] >> 4,
                          c[..., 32:64] >> 4), 2)  # [N, K / 128, 4, 32]
        top = torch.stack([(c[..., 64:] >> (2 * i)) & 3 for i in range(4)], 2)
        b = w.codes[:, wide * 3 // 4:].reshape(n, (k - wide) // BLOCK, 24)
        low = _unnibble(b[..., :16])
        h = b[..., 16:]  # [N, blocks, 8]
        tail = torch.stack([(h >> (2 * i)) & 3 for i in range(4)], 2).reshape(n, -1, BLOCK)
        return torch.cat(((lo | (top << 4)).reshape(n, wide),
                          (low | (tail << 4)).reshape(n, k - wide)), 1)
    return _unnibble(w.codes.reshape(n, k // BLOCK, BLOCK // 2)).reshape(n, k)


def dequantize(w: IntDotWeight) -> torch.Tensor:
    """W [N, K] float32."""
    n, k = w.shape
    q = unpack_codes(w).float().reshape(n, -1, w.group)
    scale, offset = group_scales(w)
    return (q * scale[..., None] + offset[..., None]).reshape(n, k)


def _round_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q, d): each 32 elements as int8 steps q of d = max|x| / 127."""
    xb = x.reshape(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return torch.round(xb * inv), d


def round_int8_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 -> each 32 elements rounded to int8 steps of max|x| / 127."""
    q, d = _round_int8(x)
    return (q * d).reshape(x.shape)


def quantize_activations_ref(x: torch.Tensor, rounds: int = 2) -> torch.Tensor:
    """x [M, K] -> x^ float32 as the kernel multiplies it: x rounded to int8 per 32, with two
    rounds plus what that left rounded the same way (two int8 products a row, added). What is
    left is x - q d rounded once to float32 (the kernel's fma: q d is exact in float64)."""
    xf = x.float()
    if rounds == 1:
        return round_int8_ref(xf)
    q, d = _round_int8(xf)
    left = (xf.reshape(q.shape).double() - q.double() * d.double()).float().reshape(xf.shape)
    return (q * d).reshape(xf.shape) + round_int8_ref(left)


def intdot_mm_ref(x: torch.Tensor, w: IntDotWeight) -> torch.Tensor:
    """The reference: x [M, K] float32 or bfloat16 -> [M, N] in x's dtype, W x^ in float64."""
    y = quantize_activations_ref(x, w.rounds).double() @ dequantize(w).double().t()
    return y.to(x.dtype)


def intdot_mm(x: torch.Tensor, w: IntDotWeight) -> torch.Tensor:
    """intdot_mm_ref's contract (float32 sums) on the compiled kernel: x [M, K] contiguous."""
    return torch.ops.skyline_cpu.intdot_mm(x, w.codes, w.scale, w.offset, w.bits, w.group,
                                           w.rounds)


def intdot_linear(x: torch.Tensor, w: IntDotWeight, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (float32 or bfloat16; others through float32)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    y = intdot_mm(x2.contiguous(), w).to(x.dtype).reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias.to(y.dtype)


def available() -> bool:
    """Whether the kernel is built (or builds now) for this machine."""
    return cpu_ext.available()


def isa() -> str | None:
    """The instruction path the build runs ("avx512_vnni", "avx_vnni", "avx2", "scalar")."""
    return torch.ops.skyline_cpu.isa() if available() else None
