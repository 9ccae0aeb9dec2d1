"""The kernels' inline PTX run by a small interpreter of its instructions (ptx_interp.py): CI has
no GPU, so this checks the tables, the permutes' selectors, the sign bits and the order of the
outputs where the kernels' CUDA tests cannot run. The grouped GEMM's MXFP4 tiles
(moe_triton._E2M1_BF16) against the reference decode for every byte and a spread of scales; the
integer mode's dot products of a scale group's code words with int8 x
(gemv_block_a8_triton._FP4_DOT_2 / _4: NVFP4, MXFP4) against the integer sum, every code at
every place of a word; the W4A8 GEMV's INT4 dot (gemv_int_a8_triton._DP4A_INT4), the INT4
tensor-core unpacking (gemv_quant_triton._INT4_ASM_*) for every byte, and the fp8 KV cache's
e4m3 conversion (attention_triton._E4M3X4_TO_F16) for every code."""

from __future__ import annotations

import re

import pytest
import torch
from ptx_interp import bf16_value, run_ptx, to_bits

from skyline.ops.fp4 import dequantize_mxfp4

pytest.importorskip("triton")  # the asm is defined where Triton is
from skyline.ops import (  # noqa: E402
    attention_triton,
    gemv_block_a8_triton,
    gemv_int_a8_triton,
    gemv_quant_triton,
    moe_triton,
)


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
            got_lo = [bf16_value(regs[r] >> 16 * h) for r in ("$0", "$1") for h in range(2)]
            got_hi = [bf16_value(regs[r] >> 16 * h) for r in ("$2", "$3") for h in range(2)]
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


def _words(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64).tolist()


def test_ptx_int4_against_int8_words_matches_the_byte_sums():
    # gemv_int_a8's W4A8 dot: a word's low nibbles against xa's bytes, its high ones xb's
    asm = str(gemv_int_a8_triton._DP4A_INT4.value)
    g = torch.Generator().manual_seed(1)
    for w, xa, xb in zip(_words(g, 200), _words(g, 200), _words(g, 200), strict=True):
        got = run_ptx(asm, {"$1": w, "$2": xa, "$3": xb})["$0"]
        want = 0
        for b in range(4):
            sa = ((xa >> 8 * b) & 0xFF) - (256 if (xa >> 8 * b) & 0x80 else 0)
            sb = ((xb >> 8 * b) & 0xFF) - (256 if (xb >> 8 * b) & 0x80 else 0)
            want += ((w >> 8 * b) & 0xF) * sa + ((w >> (8 * b + 4)) & 0xF) * sb
        assert got == want & 0xFFFFFFFF, (w, xa, xb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_int4_to_offset_floats(dtype):
    # gemv_quant's tensor-core unpacking: byte j's low / high nibble q -> OFFSET + q, exact
    asm = str((gemv_quant_triton._INT4_ASM_BF16 if dtype == torch.bfloat16
               else gemv_quant_triton._INT4_ASM_FP16).value)
    offset = 128 if dtype == torch.bfloat16 else 1024
    for word in [int.from_bytes(bytes([4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]), "little")
                 for i in range(64)]:  # every byte
        regs = run_ptx(asm, {"$4": word})
        got_lo = [regs[r] >> 16 * h & 0xFFFF for r in ("$0", "$1") for h in range(2)]
        got_hi = [regs[r] >> 16 * h & 0xFFFF for r in ("$2", "$3") for h in range(2)]
        data = word.to_bytes(4, "little")
        assert got_lo == [to_bits(offset + (b & 0xF), dtype) for b in data], hex(word)
        assert got_hi == [to_bits(offset + (b >> 4), dtype) for b in data], hex(word)


def test_ptx_e4m3_words_to_f16_in_byte_order():
    # the fp8 KV cache's conversion: byte j of a word -> output j, as fp16
    asm = str(attention_triton._E4M3X4_TO_F16.value)
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).tolist()
    for i in range(64):
        word = int.from_bytes(bytes(range(4 * i, 4 * i + 4)), "little")
        regs = run_ptx(asm, {"$4": word})
        assert [regs[f"${j}"] for j in range(4)] == [want[4 * i + j] & 0xFFFF
                                                     for j in range(4)], i
