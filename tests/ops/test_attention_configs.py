"""Launch configurations of the paged attention kernels: the tuned-table lookup (batch buckets,
split scaling, defaults) and the kernels under non-default configurations (tile sizes, pipeline
depths, KV splits at high batch) against the PyTorch reference. The kernels run on CUDA, or in
Triton's interpreter on CPU (see tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch
from paged_tables import shuffled_table

from skyline.ops import attention, attention_config
from skyline.ops.attention import (
    DECODE_KERNEL,
    PREFILL_KERNEL,
    decode_config,
    default_decode_config,
    paged_attention_ref,
    prefill_config,
    shape_key,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
needs_triton = pytest.mark.skipif(attention.triton is None, reason="needs triton")


@pytest.fixture
def table(monkeypatch):
    """A fake tuning table {(kernel, key): config} behind attention_config.get_config."""
    entries: dict[tuple[str, str], dict] = {}

    def fake_get_config(kernel, key, default):
        found = entries.get((kernel, key))
        return {**default, **found} if found else default

    monkeypatch.setattr(attention_config, "get_config", fake_get_config)
    decode_config.cache_clear()
    prefill_config.cache_clear()
    yield entries
    decode_config.cache_clear()
    prefill_config.cache_clear()


def test_shape_key_names_dtypes():
    assert shape_key(32, 8, 128, 16, BF16, BF16) == "h32x8:d128:p16:bf16:kv-bf16"
    assert shape_key(32, 8, 128, 16, BF16, torch.float8_e4m3fn).endswith(":kv-fp8")


def test_decode_config_uses_largest_tuned_batch_below(table):
    key = shape_key(32, 8, 128, 16, BF16, BF16)
    table[(DECODE_KERNEL, f"{key}:b8")] = {"BLOCK_N": 32, "num_stages": 4, "NUM_SPLITS": 4}
    table[(DECODE_KERNEL, f"{key}:b256")] = {"BLOCK_N": 128, "num_warps": 8, "NUM_SPLITS": 2}
    args = (32, 8, 128, 16, BF16, BF16)
    assert decode_config(8, *args) == {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4,
                                       "NUM_SPLITS": 4}
    # 20 sequences use the b8 entry; its 4 splits x 8 sequences become round(32 / 20) = 2
    assert decode_config(20, *args)["BLOCK_N"] == 32
    assert decode_config(20, *args)["NUM_SPLITS"] == 2
    assert decode_config(63, *args)["NUM_SPLITS"] == 1
    # 300 sequences: the b256 entry, 2 splits x 256 / 300 -> 2; 600 -> 1
    assert decode_config(300, *args)["BLOCK_N"] == 128
    assert decode_config(300, *args)["NUM_SPLITS"] == 2
    assert decode_config(600, *args)["NUM_SPLITS"] == 1
    # below every tuned batch size: the default, with the heuristic split count
    assert decode_config(4, *args) == default_decode_config(4, 8, 128, 2)
    # another shape (an fp8 cache) has no entries
    assert decode_config(8, 32, 8, 128, 16, BF16, torch.float8_e4m3fn) == default_decode_config(
        8, 8, 128, 1)


def test_decode_config_without_tuned_splits_keeps_the_heuristic(table):
    key = shape_key(32, 8, 128, 16, BF16, BF16)
    table[(DECODE_KERNEL, f"{key}:b1")] = {"BLOCK_N": 32}
    cfg = decode_config(2, 32, 8, 128, 16, BF16, BF16, 132)
    assert cfg["BLOCK_N"] == 32
    assert cfg["NUM_SPLITS"] == attention.decode_splits(2, 8, 132)


def test_prefill_config_by_token_bucket(table):
    key = shape_key(32, 8, 128, 16, BF16, BF16)
    table[(PREFILL_KERNEL, f"{key}:q1024")] = {"BLOCK_M": 128, "num_warps": 8}
    args = (32, 8, 128, 16, BF16, BF16)
    assert prefill_config(1000, *args)["BLOCK_M"] == 128
    assert prefill_config(300, *args)["num_warps"] == 8  # 300 tokens: bucket 1024 too
    assert prefill_config(8192, *args) == attention.default_prefill_config(8192, 128, 2)
    assert prefill_config(8, *args)["BLOCK_M"] == 16


def test_default_tiles_fit_the_stage_budget():
    assert default_decode_config(1, 8, 128, 2)["BLOCK_N"] == 64
    assert default_decode_config(1, 8, 128, 4)["BLOCK_N"] == 32  # fp32 cache
    assert default_decode_config(1, 8, 256, 2)["BLOCK_N"] == 32
    assert default_decode_config(1, 8, 64, 1)["BLOCK_N"] == 64
    # an fp8 cache at 256+ sequences on a GPU with fp8 units: 32-token tiles in one warp
    # (both tuned GPUs' choice); elsewhere the tiles above
    wide = default_decode_config(256, 8, 128, 1, fp8_units=True)
    assert (wide["BLOCK_N"], wide["num_warps"]) == (32, 1)
    assert default_decode_config(255, 8, 128, 1, fp8_units=True)["num_warps"] == 4
    assert default_decode_config(256, 8, 128, 1)["num_warps"] == 4
    assert default_decode_config(1024, 8, 128, 2, fp8_units=True)["num_warps"] == 4


def _cache(seq_lens, page, num_kv_heads, head_dim, seed):
    """A shuffled paged cache whose table padding points at a NaN block 0."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // page) for n in seq_lens) + 2
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, generator=g).to(DEV)
    cache[:, 0] = float("nan")
    table = shuffled_table(seq_lens, page, num_blocks, rng)
    return cache, table.to(DEV), g


@needs_triton
@pytest.mark.parametrize("config", [
    {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3, "NUM_SPLITS": 1},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "NUM_SPLITS": 2},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 4, "NUM_SPLITS": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "NUM_SPLITS": 8},
    {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "NUM_SPLITS": 1},
])
def test_decode_configs_match_reference(config):
    """Tiles smaller and larger than a page, pipelined or not, and KV splits over a batch of
    many sequences (splits at high batch): some splits of the short sequences are empty."""
    page, num_heads, num_kv_heads, head_dim = 16, 4, 2, 16
    rng = random.Random(config["BLOCK_N"])
    seq_lens = [rng.randint(1, 200) for _ in range(14)] + [1, page, 257]
    cache, table, g = _cache(seq_lens, page, num_kv_heads, head_dim, config["NUM_SPLITS"])
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(DEV)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = head_dim**-0.5
    out = attention.paged_decode_attention(q, cache, table, lens_t, scale, config=config)
    ref = paged_attention_ref(q.double(), cache.double(), list(range(len(seq_lens) + 1)),
                              seq_lens, table, scale, num_decodes=len(seq_lens),
                              seq_lens_tensor=lens_t)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err.item()


@needs_triton
@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
])
def test_prefill_configs_match_reference(config):
    """Query tiles smaller and larger than the prompts, K/V tiles smaller and larger than a
    page: fresh prompts and extends over a cached prefix in one launch."""
    page, num_heads, num_kv_heads, head_dim = 8, 4, 2, 16
    shapes = [(40, 40), (1, 30), (70, 100), (9, 9)]  # (q_len, seq_len)
    seq_lens = [s for _, s in shapes]
    cache, table, g = _cache(seq_lens, page, num_kv_heads, head_dim, config["BLOCK_M"])
    qsl = [0]
    for q_len, _ in shapes:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g).to(DEV)
    scale = head_dim**-0.5
    out = attention.paged_prefill_attention(
        q, cache, torch.tensor(qsl, dtype=torch.int32, device=DEV),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEV), table, scale,
        max(q_len for q_len, _ in shapes), config=config)
    ref = paged_attention_ref(q.double(), cache.double(), qsl, seq_lens, table, scale)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err.item()


@needs_triton
def test_bad_tile_size_is_refused():
    cache, table, g = _cache([5], 4, 1, 16, 0)
    q = torch.randn(1, 1, 16, generator=g).to(DEV)
    lens_t = torch.tensor([5], dtype=torch.int32, device=DEV)
    bad = {"BLOCK_N": 24, "num_warps": 4, "num_stages": 3, "NUM_SPLITS": 1}
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two"):
        attention.paged_decode_attention(q, cache, table, lens_t, 0.25, config=bad)
