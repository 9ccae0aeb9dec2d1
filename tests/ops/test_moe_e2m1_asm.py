"""The grouped GEMM's MXFP4 decode in PTX (moe_triton._E2M1_BF16) run by a small interpreter of
its instructions, against the reference decode, for every byte and a spread of scales: CI has
no GPU, so this checks the tables, the permutes' selectors and the sign bits where the kernel's
CUDA test cannot run."""

from __future__ import annotations

import re
import struct

import pytest
import torch

from skyline.ops.fp4 import dequantize_mxfp4

pytest.importorskip("triton")  # the asm is defined where Triton is
from skyline.ops import moe_triton  # noqa: E402

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, sel: int) -> int:
    # PTX prmt.b32 (default mode): byte k of the result is byte (sel >> 4k) & 7 of {b, a},
    # or that byte's sign bit replicated where bit 3 of the selector's nibble is set
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        nib = (sel >> 4 * k) & 0xF
        v = pool[nib & 7]
        out |= ((0xFF if v & 0x80 else 0) if nib & 8 else v) << 8 * k
    return out


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16_bits(x: float) -> int:
    t = torch.tensor([x], dtype=torch.float32).bfloat16().view(torch.int16).item()
    return t & 0xFFFF


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for h in range(2):
        x = _bf16(a >> 16 * h) * _bf16(b >> 16 * h) + _bf16(c >> 16 * h)
        out |= _to_bf16_bits(x) << 16 * h
    return out


OPS = {"mov.b32": lambda v: v[0], "and.b32": lambda v: v[0] & v[1],
       "or.b32": lambda v: v[0] | v[1], "shl.b32": lambda v: (v[0] << v[1]) & MASK,
       "shr.b32": lambda v: v[0] >> v[1], "prmt.b32": lambda v: _prmt(*v),
       "fma.rn.bf16x2": lambda v: _fma_bf16x2(*v)}


def run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Interpret the instructions the decode uses (OPS, on b32 registers), `regs` holding its
    operands $0..$6."""
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith("//"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        regs[d] = OPS[op]([regs[t] if t in regs else int(t, 0) for t in src])
    return regs


def test_ptx_decode_matches_the_reference():
    asm = str(moe_triton._E2M1_BF16.value)
    assert set(re.findall(r"\$(\d)", asm)) == {str(i) for i in range(7)}
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8)  # every byte, four to a word
    for exps in (torch.full((4,), 127), torch.randint(100, 140, (4,), generator=g),
                 torch.tensor([1, 60, 200, 254])):  # 0 reads as 0, as _e8m0_to_f32's
        words = codes.view(64, 4)
        scale_bits = [(int(e) << 7) for e in exps]  # 2^(e - 127) in bf16
        for w in words:
            regs = run_ptx(asm, {"$4": int.from_bytes(bytes(w.tolist()), "little"),
                                 "$5": scale_bits[0] | scale_bits[1] << 16,
                                 "$6": scale_bits[2] | scale_bits[3] << 16})
            got_lo = [_bf16(regs[r] >> 16 * h) for r in ("$0", "$1") for h in range(2)]
            got_hi = [_bf16(regs[r] >> 16 * h) for r in ("$2", "$3") for h in range(2)]
            # the reference: each byte as a row of 32 values, its code repeated, one scale
            rows = w.view(4, 1).expand(4, 16).contiguous()
            want = dequantize_mxfp4(rows, exps.to(torch.uint8).view(4, 1)).float()
            assert got_lo == want[:, 0].tolist() and got_hi == want[:, 1].tolist(), (w, exps)
