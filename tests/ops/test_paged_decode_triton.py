"""The Triton paged decode kernel against the PyTorch reference, over a sweep of shapes.
Runs on CUDA, or in Triton's interpreter on CPU (see tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from paged_tables import shuffled_table  # noqa: E402

from skyline.ops.attention import paged_attention_ref, paged_decode_attention  # noqa: E402
from skyline.ops.attention_triton import _e4m3_words_to_f16  # noqa: E402
from skyline.ops.gemv_int_a8 import int8_chunks_ref  # noqa: E402
from skyline.ops.kv_quant import FP8_DTYPE, quantize_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (9, 3, 64),
                                                             (32, 8, 128)])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, page, dtype, num_splits):
    if DEV == "cpu" and (head_dim > 64 or dtype != torch.float32):
        pytest.skip("interpreter: small fp32 shapes only")
    rng = random.Random(head_dim * page)
    g = torch.Generator().manual_seed(page)
    seq_lens = [rng.randint(1, 150) for _ in range(5)] + [1, page, page + 1]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 4
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g).to(DEV, dtype)
    # the table points at shuffled blocks; its padding at block 0 which holds NaN
    cache[:, 0] = float("nan")
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(DEV, dtype)
    table, lens_t = table.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, cache, table, lens_t, scale, num_splits)
    qsl = list(range(len(seq_lens) + 1))
    ref = paged_attention_ref(q.double(), cache.double(), qsl, seq_lens, table, scale,
                              num_decodes=len(seq_lens), seq_lens_tensor=lens_t)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err.item()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (9, 3, 64),
                                                             (2, 1, 24), (32, 8, 128)])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("one_warp", [False, True])
def test_decode_fp8_cache_matches_reference(num_heads, num_kv_heads, head_dim, page, dtype,
                                            num_splits, one_warp):
    """An fp8 cache holding K / k_scale and V / v_scale: the kernel dequantizes as it reads
    (with `one_warp`, in the 32-token tiles of one warp an fp8 cache takes at 256+ sequences)."""
    if DEV == "cpu" and (head_dim > 32 or dtype != torch.float32):
        pytest.skip("interpreter: small fp32 shapes only")
    rng = random.Random(head_dim + page)
    g = torch.Generator().manual_seed(page + 1)
    seq_lens = [rng.randint(1, 90) for _ in range(3)] + [1, page + 1]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 2
    k_scale, v_scale = 0.03, 0.005
    kv = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g)
    cache = torch.stack([quantize_kv(kv[0] * 4, FP8_DTYPE, k_scale),
                         quantize_kv(kv[1] * 0.5, FP8_DTYPE, v_scale)]).to(DEV)
    cache[:, 0] = float("nan")  # table padding points here; the kernel must never read it
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(DEV, dtype)
    table, lens_t = table.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    config = ({"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "NUM_SPLITS": num_splits}
              if one_warp else None)
    out = paged_decode_attention(q, cache, table, lens_t, scale, num_splits,
                                 k_scale=k_scale, v_scale=v_scale, config=config)
    qsl = list(range(len(seq_lens) + 1))
    ref = paged_attention_ref(q.double(), cache, qsl, seq_lens, table, scale,
                              num_decodes=len(seq_lens), seq_lens_tensor=lens_t,
                              k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(out).all()
    assert ref.abs().max() > 0.1  # v_scale applied: outputs of the size of V (~0.5)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err.item()


def test_e4m3_words_convert_every_byte():
    """An fp8 cache is read as int32 words and converted four bytes at a time (PTX on a GPU,
    byte by byte in the interpreter): every e4m3 byte, at every position of a word, gives
    torch's fp16 value (NaN for NaN)."""
    @triton.jit
    def convert(words_ptr, out_ptr, W: tl.constexpr, ASM: tl.constexpr):
        n = tl.arange(0, 64)
        w = tl.arange(0, W)
        f16 = _e4m3_words_to_f16(tl.load(words_ptr + n[:, None] * W + w[None, :]), ASM)
        c = tl.arange(0, 4 * W)
        tl.store(out_ptr + n[:, None] * 4 * W + c[None, :], f16)

    codes = torch.arange(256, dtype=torch.uint8)
    asm = DEV == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    for roll in range(4):  # each byte at each of the four positions of a word
        fp8 = codes.roll(roll).reshape(64, 4).view(FP8_DTYPE)
        out = torch.empty(64, 4, dtype=torch.float16, device=DEV)
        convert[(1,)](fp8.view(torch.int32).to(DEV), out, W=1, ASM=asm)
        want = fp8.to(torch.float16)
        assert torch.equal(out.cpu().isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(out.cpu()[ok], want[ok])


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,num_splits,rounds", [
    (4, 2, 32, 3, True), (2, 2, 64, 2, True), (32, 8, 128, 4, True),
    (4, 2, 32, 1, False),  # no combine kernel: the plain output
    (4, 4, 16, 3, False),  # heads narrower than a chunk: the plain output
])
def test_decode_int8_out_is_the_output_rounded(num_heads, num_kv_heads, head_dim, num_splits,
                                               rounds):
    """With int8_out the split combine hands the output over rounded for the W4A8 GEMV:
    int8_chunks_ref of the [seqs, heads * head_dim] output it stores, bit for bit."""
    if DEV == "cpu" and head_dim > 64:
        pytest.skip("interpreter: small shapes only")
    rng = random.Random(head_dim + num_splits)
    g = torch.Generator().manual_seed(head_dim)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    seq_lens, page = [37, 1, 90], 16
    num_blocks = sum(-(-n // page) for n in seq_lens) + 2
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g).to(DEV, dtype)
    table = shuffled_table(seq_lens, page, num_blocks, rng).to(DEV)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(DEV, dtype)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    plain = paged_decode_attention(q, cache, table, lens_t, 0.1, num_splits)
    got = paged_decode_attention(q, cache, table, lens_t, 0.1, num_splits, int8_out=True)
    if not rounds:
        assert torch.equal(got, plain)
        return
    want = int8_chunks_ref(plain.flatten(1))
    assert got.dtype == dtype and got.cols == num_heads * head_dim
    assert torch.equal(got.words, want.words) and torch.equal(got.floats, want.floats)
