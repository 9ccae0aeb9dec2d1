"""The CPU's few-operation paths of a decode step against their references, over shapes and
dtypes: RMSNorm through LayerNorm of [x, -x], rotary in three elementwise operations, and paged
decode attention with one gather (no Triton needed)."""

from __future__ import annotations

import pytest
import torch

from skyline.ops.attention import paged_attention, paged_attention_ref
from skyline.ops.attention_ref import _decode_ref
from skyline.ops.cpu_attention import decode_attention_cpu, decode_gather
from skyline.ops.kv_quant import FP8_DTYPE
from skyline.ops.kv_write import write_kv, write_kv_ref
from skyline.ops.norm import rms_norm_cpu, rms_norm_ref
from skyline.ops.rotary import rotary_cpu, rotary_embedding_ref, rotation_operands

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().clamp_min(1.0)
    assert (got.float() - want.float()).abs().max() / scale < TOL[want.dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 576), (7, 64), (64, 96), (3, 4096)])
def test_rms_norm_cpu(dtype, rows, d):
    g = torch.Generator().manual_seed(rows * 100 + d)
    x = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    got, want = rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5)
    close(got, want)
    if dtype == torch.bfloat16:  # one rounding of the float32 norm, then the weight: as HF
        assert torch.equal(got, want)
    close(rms_norm_cpu(x, w.float(), 1e-5), rms_norm_ref(x, w.float(), 1e-5))  # promotes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 17, 300])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 16), (32, 8, 128)])
@pytest.mark.parametrize("layout", ["qkv", "separate"])
def test_rotary_cpu(dtype, tokens, heads, kv_heads, d, layout):
    g = torch.Generator().manual_seed(tokens * 31 + heads + d)
    cache = torch.randn(300, d, generator=g)
    pos = torch.randint(0, 300, (tokens,), generator=g)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.unflatten(-1, (heads, d)), k.unflatten(-1, (kv_heads, d))
    if layout == "separate":
        q, k = q.clone(), k.clone()
    q_before, k_before, v_before = q.clone(), k.clone(), qkv[:, (heads + kv_heads) * d :].clone()
    want_q, want_k = rotary_embedding_ref(pos, q, k, cache)
    got_q, got_k = rotary_cpu(*rotation_operands(pos, cache, dtype), q, k)
    close(got_q, want_q)
    close(got_k, want_k)
    if layout == "separate":  # new tensors, as the ref
        assert torch.equal(q, q_before) and torch.equal(k, k_before)
    else:  # in place in the projection, as on CUDA; v untouched
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
        assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)


def _paged(lens: list[int], kvh: int, d: int, bs: int, dtype: torch.dtype, seed: int):
    """A cache holding the sequences' blocks in shuffled order, the rest NaN."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 2
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
    cache[:, -2:] = float("nan")
    tables = torch.full((len(lens), max(per) + 2), nb - 1, dtype=torch.int32)
    order = torch.randperm(nb - 2, generator=g).to(torch.int32)
    at = 0
    for i, n in enumerate(per):
        tables[i, :n] = order[at : at + n]
        at += n
    return cache, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1], [77], [16, 16], [5, 40, 33], [64 + 7 * i for i in range(16)]
                                  ], ids=lambda x: f"b{len(x)}")
@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 8)])
def test_decode_attention_cpu(dtype, lens, heads, kv_heads, d, bs):
    cache, tables = _paged(lens, kv_heads, d, bs, dtype, seed=len(lens) + d)
    q = torch.randn(len(lens), heads, d).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    want = _decode_ref(q, cache, lens, tables, d**-0.5, lens_t, 1.0, 1.0)
    got = decode_attention_cpu(q, cache, decode_gather(lens, tables, bs, lens_t), d**-0.5)
    assert not got.isnan().any()
    close(got, want)
    gather = decode_gather(lens, tables, bs)  # lengths from the list
    close(decode_attention_cpu(q, cache, gather, d**-0.5), want)


def test_decode_attention_cpu_fp8_cache_scales():
    lens = [20, 9]
    cache, tables = _paged(lens, 2, 32, 8, torch.float32, seed=5)
    cache = cache.clamp(-4, 4).to(FP8_DTYPE)
    q = torch.randn(2, 4, 32)
    want = _decode_ref(q, cache, lens, tables, 0.2, None, 0.5, 2.0)
    gather = decode_gather(lens, tables, 8)
    close(decode_attention_cpu(q, cache, gather, 0.2, 0.5, 2.0), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_write_kv_on_cpu_is_the_reference(dtype, tokens):
    cache = torch.randn(2, 6, 4, 2, 8).to(dtype)
    want = cache.clone()
    k, v = torch.randn(tokens, 2, 8).to(dtype), torch.randn(tokens, 2, 8).to(dtype)
    slots = torch.randperm(24)[:tokens]
    write_kv(k, v, cache, slots)
    write_kv_ref(k, v, want, slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("heads", [0, 3])
def test_write_kv_on_cpu_reads_neighbouring_views_in_place(tokens, heads):
    # k and v as a qkv projection's slices (v right after k): stored as the reference stores
    # copies of them
    cache = torch.randn(2, 6, 4, 2, 8).to(torch.bfloat16)
    want = cache.clone()
    qkv = torch.randn(tokens, (heads + 4) * 8).to(torch.bfloat16)
    _, k, v = qkv.split([heads * 8, 16, 16], dim=-1)
    k, v = k.unflatten(-1, (2, 8)), v.unflatten(-1, (2, 8))
    slots = torch.randperm(24)[:tokens]
    write_kv(k, v, cache, slots)
    write_kv_ref(k.clone(), v.clone(), want, slots)
    assert torch.equal(cache, want)


def test_paged_attention_on_cpu_mixes_decodes_and_extends():
    # two decodes, then a sequence extending by 5 tokens: the dispatch's output is the ref's
    lens = [30, 12, 21]
    cache, tables = _paged(lens, 2, 16, 4, torch.float32, seed=9)
    loc = [0, 1, 2, 7]
    q = torch.randn(7, 4, 16)
    want = paged_attention_ref(q, cache, loc, lens, tables, 0.25, num_decodes=2)
    got = paged_attention(q, cache, loc, lens, tables, 0.25, num_decodes=2,
                          seq_lens_tensor=torch.tensor(lens, dtype=torch.int32))
    close(got, want)
