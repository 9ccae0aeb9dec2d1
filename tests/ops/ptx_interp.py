"""A small interpreter of the PTX that skyline's kernels inline (tl.inline_asm_elementwise), for
the tests that check it on a machine without a GPU: the instructions those pieces use, on
integer registers holding the bits (b16, b32, b64), as the PTX ISA defines them."""

from __future__ import annotations

import re
import struct

import torch

MASK = 0xFFFFFFFF


def _signed(v: int, bits: int) -> int:
    return v - (1 << bits) if v >> (bits - 1) & 1 else v


def _prmt(a: int, b: int, sel: int) -> int:
    # prmt.b32 (default mode): byte k of the result is byte (sel >> 4k) & 7 of {b, a}, or that
    # byte's sign bit replicated where bit 3 of the selector's nibble is set; bits 16-31 of the
    # selector are not read
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        nib = (sel >> 4 * k) & 0xF
        v = pool[nib & 7]
        out |= ((0xFF if v & 0x80 else 0) if nib & 8 else v) << 8 * k
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    # bit i of the result: bit (a_i << 2 | b_i << 1 | c_i) of lut
    return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i
               for i in range(32))


def _dp4a(a: int, b: int, c: int, a_signed: bool) -> int:
    # dp4a.{u32,s32}.s32: c + the products of a's bytes (signed or not) and b's signed bytes
    aa = [(a >> 8 * i) & 0xFF for i in range(4)]
    if a_signed:
        aa = [_signed(v, 8) for v in aa]
    bb = [_signed((b >> 8 * i) & 0xFF, 8) for i in range(4)]
    return (_signed(c, 32) + sum(x * y for x, y in zip(aa, bb, strict=True))) & MASK


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def to_bits(x: float, dtype: torch.dtype) -> int:
    return torch.tensor([x], dtype=torch.float32).to(dtype).view(torch.int16).item() & 0xFFFF


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for h in range(2):
        x = (bf16_value(a >> 16 * h) * bf16_value(b >> 16 * h) + bf16_value(c >> 16 * h))
        out |= to_bits(x, torch.bfloat16) << 16 * h
    return out


def _e4m3x2_to_f16x2(a: int) -> int:
    # cvt.rn.f16x2.e4m3x2: the low byte of a to the low half, the high byte to the high half
    codes = torch.tensor([a & 0xFF, (a >> 8) & 0xFF], dtype=torch.uint8)
    halves = codes.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).tolist()
    return (halves[0] & 0xFFFF) | (halves[1] & 0xFFFF) << 16


OPS = {"mov.b32": lambda v: v[0], "and.b32": lambda v: v[0] & v[1],
       "or.b32": lambda v: v[0] | v[1], "shl.b32": lambda v: (v[0] << v[1]) & MASK,
       "shr.b32": lambda v: v[0] >> v[1], "shr.u32": lambda v: v[0] >> v[1],
       "prmt.b32": lambda v: _prmt(*v), "lop3.b32": lambda v: _lop3(*v),
       "fma.rn.bf16x2": lambda v: _fma_bf16x2(*v),
       "dp4a.s32.s32": lambda v: _dp4a(*v, a_signed=True),
       "dp4a.u32.s32": lambda v: _dp4a(*v, a_signed=False),
       "cvt.rn.f16x2.e4m3x2": lambda v: _e4m3x2_to_f16x2(v[0])}


def run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Interpret `asm` (OPS, and `mov.bN {lo, hi}, src`: src's two halves), `regs` holding its
    operands $0.. as bits; returns the registers after it."""
    for stmt in re.split(r"[;\n]", asm):
        stmt = stmt.strip().lstrip("{").strip()
        if not stmt or stmt[0] in "}." or stmt.startswith("//"):
            continue
        op, args = stmt.split(None, 1)
        pair = re.fullmatch(r"\{\s*([\w$]+),\s*([\w$]+)\s*\},\s*([\w$]+)", args)
        if op.startswith("mov.b") and pair:  # mov.bN {lo, hi}, src
            half = int(op[5:]) // 2
            lo, hi, src = pair.groups()
            regs[lo], regs[hi] = regs[src] & ((1 << half) - 1), regs[src] >> half
            continue
        d, *src = [a.strip() for a in args.split(",")]
        regs[d] = OPS[op]([regs[t] if t in regs else int(t, 0) for t in src])
    return regs
