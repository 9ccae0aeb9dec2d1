"""ops/attention_dense.py: a long extend's attention from gathered segments merged by
log-sum-exp, against paged_attention_ref (its PyTorch form on the CPU, "math"; cuDNN's kernel
and the dispatch from paged_attention on a GPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from paged_tables import shuffled_table

from skyline import envs
from skyline.ops.attention import paged_attention, paged_attention_ref
from skyline.ops.attention_dense import DENSE_MIN_QUERY, dense_backend, dense_extend
from skyline.ops.kv_quant import FP8_DTYPE


def _case(prior: int, t: int, heads: int, kvh: int, d: int, page: int, cache_dtype, seed: int,
          device: str = "cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = prior + t
    table = shuffled_table([n], page, -(-n // page) + 5, random.Random(seed)).to(device)
    cache = torch.randn(2, table.max().item() + 1, page, kvh, d, generator=g)
    cache[:, 0] = float("nan")  # table padding points at block 0
    cache = cache.to(device=device, dtype=cache_dtype)
    q = torch.randn(t, heads, d, generator=g).to(device=device, dtype=dtype)
    return q, cache, table


@pytest.fixture
def dense_on(monkeypatch):
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV,
                                                         dense_prefill_tokens=DENSE_MIN_QUERY))


@pytest.mark.parametrize("prior,t,segment", [(0, 9, 64), (37, 12, 16), (64, 16, 16),
                                             (100, 5, 32), (130, 33, 1000)])
@pytest.mark.parametrize("heads,kvh,page", [(4, 4, 4), (8, 2, 16), (6, 1, 1)])
def test_segments_match_reference(prior, t, segment, heads, kvh, page):
    q, cache, table = _case(prior, t, heads, kvh, 16, page, torch.float32, seed=prior + t)
    scale = 16 ** -0.5
    ref = paged_attention_ref(q, cache, [0, t], [prior + t], table, scale, 0)
    out = dense_extend(q, cache, table[0], prior + t, scale, backend="math", segment=segment)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_fp8_cache_scales():
    q, cache, table = _case(50, 20, 8, 2, 16, 4, torch.float32, seed=3)
    cache = cache.to(FP8_DTYPE)
    scale, ks, vs = 0.25, 0.05, 0.03
    ref = paged_attention_ref(q, cache, [0, 20], [70], table, scale, 0, k_scale=ks, v_scale=vs)
    out = dense_extend(q, cache, table[0], 70, scale, ks, vs, backend="math", segment=16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dispatch_by_query_and_work(monkeypatch):
    # unset: extends of DENSE_MIN_QUERY tokens and more whose queries x keys reach
    # DENSE_MIN_WORK; SKYLINE_DENSE_PREFILL_TOKENS=0: none; never with a window
    import skyline.ops.attention_dense as dense

    monkeypatch.setattr(dense, "dense_backend", lambda q, kvh: "math")
    q = torch.zeros(8192, 8, 16)
    cache = torch.zeros(2, 4, 16, 2, 16)
    monkeypatch.delenv("SKYLINE_DENSE_PREFILL_TOKENS", raising=False)
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    loc = [0, 8192, 8192 + 2048, 8192 + 4096, 8192 + 4096 + 2047]
    lens = [8192, 2048, 20000, 100000]  # 8192 x 8192 and 2048 x 32768 are DENSE_MIN_WORK
    assert dense.DENSE_MIN_WORK == 8192 * 8192
    assert dense.long_extends(q, cache, loc, lens, range(4), 0, None) == [0]
    assert dense.long_extends(q, cache, loc, [8192, 32768, 16383, 10**6], range(4), 0,
                              None) == [0, 1]  # 2048 x 16383 falls short
    assert dense.long_extends(q, cache, loc, lens, range(1, 4), 0, None) == []
    assert dense.long_extends(q, cache, loc, lens, range(4), 128, None) == []  # a window
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, dense_prefill_tokens=0))
    assert dense.long_extends(q, cache, loc, lens, range(4), 0, None) == []
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, dense_prefill_tokens=1024))
    assert dense.long_extends(q, cache, loc, [8192, 32768, 20000, 10**6], range(4), 0,
                              None) == [0, 1, 3]  # 2047 x 10**6 with the lower threshold


def test_no_backend_on_the_cpu():
    assert dense_backend(torch.zeros(4, 8, 16), 2) is None
    assert dense_backend(torch.zeros(4, 8, 16, dtype=torch.bfloat16), 2) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prior", [0, 3000, 70000])
@pytest.mark.parametrize("fp8", [False, True])
def test_cudnn_matches_the_paged_kernel(prior, fp8, dense_on):
    t = DENSE_MIN_QUERY + 100
    q, cache, table = _case(prior, t, 32, 8, 128, 16, torch.bfloat16, seed=prior, device="cuda",
                            dtype=torch.bfloat16)
    if dense_backend(q, 8) is None:
        pytest.skip("torch has no cuDNN attention here")
    ks, vs = (0.02, 0.03) if fp8 else (1.0, 1.0)
    if fp8:
        cache = (cache.float() * 4).to(FP8_DTYPE)  # K / k_scale stored: values up to ~18
    scale = 128 ** -0.5
    n = prior + t
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    loc = torch.tensor([0, t], dtype=torch.int32, device="cuda")
    kw = dict(seq_lens_tensor=lens, query_start_loc_tensor=loc, k_scale=ks, v_scale=vs)
    dense = paged_attention(q, cache, [0, t], [n], table, scale, **kw)
    assert torch.equal(dense, paged_attention(q, cache, [0, t], [n], table, scale, **kw))
    from skyline.ops.attention import paged_prefill_attention

    paged = paged_prefill_attention(q, cache, loc, lens, table, scale, t, ks, vs)
    torch.testing.assert_close(dense.float(), paged.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_long_chunk_beside_decodes_and_short_extends(dense_on):
    # two decodes, a short extend, a long chunk, another short extend: the long one dense, the
    # short ones through the paged kernel as a batch of their own, the decodes as ever
    from skyline.ops.attention import paged_prefill_attention

    g = torch.Generator().manual_seed(7)
    seqs = [(40, 1), (900, 1), (30, 50), (33000, DENSE_MIN_QUERY + 3), (0, 300)]
    lens = [c + t for c, t in seqs]
    table = shuffled_table(lens, 16, sum(-(-n // 16) for n in lens) + 4, random.Random(7))
    cache = torch.randn(2, table.max().item() + 1, 16, 8, 128, generator=g)
    cache = cache.to("cuda", torch.bfloat16)
    table = table.cuda()
    loc = [0]
    for _, t in seqs:
        loc.append(loc[-1] + t)
    q = torch.randn(loc[-1], 32, 128, generator=g).to("cuda", torch.bfloat16)
    if dense_backend(q, 8) is None:
        pytest.skip("torch has no cuDNN attention here")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    loc_t = torch.tensor(loc, dtype=torch.int32, device="cuda")
    scale = 128 ** -0.5
    out = paged_attention(q, cache, loc, lens, table, scale, num_decodes=2,
                          seq_lens_tensor=lens_t, query_start_loc_tensor=loc_t)
    ref = paged_attention_ref(q.float(), cache.float(), loc, lens, table, scale, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    paged = paged_prefill_attention(q[2:], cache, loc_t[2:] - 2, lens_t[2:], table[2:], scale,
                                    DENSE_MIN_QUERY + 3)
    torch.testing.assert_close(out[2:].float(), paged.float(), atol=2e-2, rtol=2e-2)


def test_workspace_counted_only_when_a_chunk_can_take_the_path(monkeypatch):
    from skyline.ops.attention_dense import SEGMENT, workspace_bytes

    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, dense_prefill_tokens=0))
    assert workspace_bytes(32, 8, 128, 8192, 2) == 0
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, dense_prefill_tokens=2048))
    assert workspace_bytes(32, 8, 128, 1024, 2) == 0  # the step budget is below the threshold
    got = workspace_bytes(32, 8, 128, 8192, 2)
    assert got == 2 * SEGMENT * 8 * 128 * 2 + 8192 * 32 * 128 * 12  # Llama-3.1-8B: ~0.66 GB
