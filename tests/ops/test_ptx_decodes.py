"""The E2M1 decodes in PTX run by a small interpreter of their instructions: CI has no GPU, so
this checks the tables, the permutes' selectors and the sign bits where the kernels' CUDA tests
cannot run. The grouped GEMM's MXFP4 tiles (moe_triton._E2M1_BF16) against the reference decode
for every byte and a spread of scales; the integer mode's dot products of a scale group's code
words with int8 x (gemv_block_a8_triton._FP4_DOT_2 / _4: NVFP4, MXFP4) against the integer sum,
every code at every place of a word."""

from __future__ import annotations

import re
import struct

import pytest
import torch

from skyline.ops.fp4 import dequantize_mxfp4

pytest.importorskip("triton")  # the asm is defined where Triton is
from skyline.ops import gemv_block_a8_triton, moe_triton  # noqa: E402

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


def _dp4a(a: int, b: int, c: int) -> int:
    # dp4a.s32.s32: c + the products of a's and b's signed bytes, in int32
    sb = [((v >> 8 * i) & 0xFF) - (256 if (v >> 8 * i) & 0x80 else 0) for v in (a, b)
          for i in range(4)]
    c = c - (1 << 32) if c & 0x80000000 else c
    return (c + sum(sb[i] * sb[4 + i] for i in range(4))) & MASK


OPS = {"mov.b32": lambda v: v[0], "and.b32": lambda v: v[0] & v[1],
       "or.b32": lambda v: v[0] | v[1], "shl.b32": lambda v: (v[0] << v[1]) & MASK,
       "shr.b32": lambda v: v[0] >> v[1], "prmt.b32": lambda v: _prmt(*v),
       "fma.rn.bf16x2": lambda v: _fma_bf16x2(*v), "dp4a.s32.s32": lambda v: _dp4a(*v)}


def run_ptx(asm: str, regs: dict[str, int]) -> dict[str, int]:
    """Interpret the instructions the decodes use (OPS, on b32 registers, and mov.b64's split
    of a 64-bit operand into two), `regs` holding their operands $0.."""
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith("//"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b64":  # mov.b64 {lo, hi}, $n
            lo, hi, src = re.fullmatch(r"\{(\w+), (\w+)\}, (\$\d+)", args).groups()
            regs[lo], regs[hi] = regs[src] & MASK, regs[src] >> 32
            continue
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


E2M1_DOUBLED = [0, 1, 2, 3, 4, 6, 8, 12]


@pytest.mark.parametrize("words", [2, 4])
def test_ptx_group_dot_matches_the_integer_sum(words):
    asm = str((gemv_block_a8_triton._FP4_DOT_2 if words == 2
               else gemv_block_a8_triton._FP4_DOT_4).value)
    assert set(re.findall(r"\$(\d)", asm)) == {str(i) for i in range(2 * words + 1)}
    g = torch.Generator().manual_seed(0)
    for trial in range(48):
        # trial t < 16 puts code (t + place) % 16 at every place; then random codes
        codes = (torch.tensor([[(trial + 8 * w + i) % 16 for i in range(8)]
                               for w in range(words)]) if trial < 16
                 else torch.randint(0, 16, (words, 8), generator=g))
        xs = torch.randint(-127, 128, (words, 8), generator=g)
        if trial % 5 == 4:  # the extremes of x
            xs = torch.where(xs > 0, 127, -127)
        regs = {}
        for w in range(words):
            regs[f"${1 + w}"] = sum(int(c) << 4 * i for i, c in enumerate(codes[w]))
            regs[f"${1 + words + w}"] = sum((int(x) & 0xFF) << 8 * i for i, x in enumerate(xs[w]))
        got = run_ptx(asm, regs)["$0"]
        got = got - (1 << 32) if got & 0x80000000 else got
        want = sum((-1 if c >= 8 else 1) * E2M1_DOUBLED[int(c) & 7] * int(x)
                   for c, x in zip(codes.flatten(), xs.flatten(), strict=True))
        assert got == want, (codes, xs)
