"""The Triton paged prefill/extend kernel against the PyTorch reference: variable lengths,
cached prefixes, GQA, one launch. Runs on CUDA, or in Triton's interpreter on CPU."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")

from paged_tables import shuffled_table  # noqa: E402

from skyline.ops.attention import paged_attention_ref, paged_prefill_attention  # noqa: E402
from skyline.ops.kv_quant import FP8_DTYPE, quantize_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 3, 32),
                                                             (32, 8, 128)])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pack", [False, True])
def test_prefill_matches_reference(num_heads, num_kv_heads, head_dim, page, dtype, pack):
    if DEV == "cpu" and (head_dim > 32 or dtype != torch.float32):
        pytest.skip("interpreter: small fp32 shapes only")
    rng = random.Random(head_dim + page)
    g = torch.Generator().manual_seed(page)
    # (q_len, seq_len): fresh prompts, extends over a cached prefix, chunks, a single token
    shapes = [(rng.randint(1, 80), 0) for _ in range(3)] + [(17, 40), (1, 33), (70, 70), (5, 6)]
    shapes += [(9, 150), (40, 203)]  # long cached prefixes: unmasked tiles before the diagonal
    shapes = [(q, max(q, s)) for q, s in shapes]
    seq_lens = [s for _, s in shapes]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 3
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g).to(DEV, dtype)
    cache[:, 0] = float("nan")  # table padding points here; the kernel must never read it
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    qsl = [0]
    for q_len, _ in shapes:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g).to(DEV, dtype)
    table = table.to(DEV)
    scale = head_dim**-0.5
    # pack: the query heads of a kv head in one program (the kernel's PACK), 16 tokens a tile
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "PACK": 2} \
        if pack else None
    out = paged_prefill_attention(
        q, cache, torch.tensor(qsl, dtype=torch.int32, device=DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV), table, scale,
        max(q_len for q_len, _ in shapes), config=config)
    ref = paged_attention_ref(q.double(), cache.double(), qsl, seq_lens, table, scale)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err.item()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 3, 32),
                                                             (2, 1, 24), (32, 8, 128)])
@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_fp8_cache_matches_reference(num_heads, num_kv_heads, head_dim, page, dtype):
    """An fp8 cache holding K / k_scale and V / v_scale: the kernel dequantizes as it reads."""
    if DEV == "cpu" and (head_dim > 32 or dtype != torch.float32):
        pytest.skip("interpreter: small fp32 shapes only")
    rng = random.Random(head_dim * page)
    g = torch.Generator().manual_seed(page + 2)
    shapes = [(rng.randint(1, 40), 0), (17, 40), (1, 33), (5, 6)]  # (q_len, seq_len)
    shapes = [(q, max(q, s)) for q, s in shapes]
    seq_lens = [s for _, s in shapes]
    num_blocks = sum(-(-n // page) for n in seq_lens) + 2
    k_scale, v_scale = 0.03, 0.005
    kv = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g)
    cache = torch.stack([quantize_kv(kv[0] * 4, FP8_DTYPE, k_scale),
                         quantize_kv(kv[1] * 0.5, FP8_DTYPE, v_scale)]).to(DEV)
    cache[:, 0] = float("nan")  # table padding points here; the kernel must never read it
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    qsl = [0]
    for q_len, _ in shapes:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g).to(DEV, dtype)
    table = table.to(DEV)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q, cache, torch.tensor(qsl, dtype=torch.int32, device=DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV), table, scale,
        max(q_len for q_len, _ in shapes), k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_ref(q.double(), cache, qsl, seq_lens, table, scale,
                              k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(out).all()
    assert ref.abs().max() > 0.1  # v_scale applied: outputs of the size of V (~0.5)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err.item()
