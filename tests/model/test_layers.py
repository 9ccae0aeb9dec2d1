"""Model layers in isolation: rope against HF's ROPE_INIT_FUNCTIONS at real sizes, RMSNorm with
the fused residual, merged-linear weight loading."""

from __future__ import annotations

import pytest
import torch

from skyline.config import ConfigError
from skyline.model.layers.linear import MergedLinear, QKVLinear
from skyline.model.layers.norm import RMSNorm
from skyline.model.layers.rotary import RotaryEmbedding

transformers = pytest.importorskip("transformers")

ROPES = {
    "default": (10000.0, None, 4096),
    "linear": (10000.0, dict(rope_type="linear", factor=4.0), 4096),
    "dynamic": (10000.0, dict(rope_type="dynamic", factor=2.0), 4096),
    "llama3 (Llama-3.1-8B)": (
        500000.0,
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=8192),
        16384,
    ),
    "yarn (Qwen)": (
        1000000.0, dict(type="yarn", factor=4.0, original_max_position_embeddings=8192), 8192,
    ),
    "yarn mscale": (
        10000.0,
        dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0,
             mscale_all_dim=0.8, beta_fast=16, beta_slow=2),
        4096,
    ),
}


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_cache_matches_hf(name):
    theta, scaling, max_pos = ROPES[name]
    head_dim = 128
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_theta=theta, rope_scaling=scaling,
    )
    hf = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 2, 77, 1000, max_pos // 2 + 3, max_pos - 1])
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, T, head_dim]
    rope = RotaryEmbedding(head_dim, max_pos, theta, scaling)
    got = rope.cos_sin_cache[positions]  # [T, head_dim]: cos half, sin half
    half = head_dim // 2
    torch.testing.assert_close(got[:, :half].repeat(1, 2), cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(got[:, half:].repeat(1, 2), sin[0], atol=1e-6, rtol=0)


def test_rope_rotates_like_hf_apply():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = RotaryEmbedding(16, 64, 10000.0)
    positions = torch.tensor([5, 0, 63, 17])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    cos_sin = rope.cos_sin_cache[positions]
    cos, sin = cos_sin[:, :8].repeat(1, 2), cos_sin[:, 8:].repeat(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)


def test_unsupported_rope_type():
    with pytest.raises(ConfigError, match="rope scaling type 'longrope' is not supported"):
        RotaryEmbedding(16, 64, 10000.0, dict(rope_type="longrope", factor=2.0))


def test_rmsnorm_fused_residual_matches_unfused():
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x, res = torch.randn(5, 32), torch.randn(5, 32)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm(x + res))
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(32, eps=1e-6)
    hf.weight.data.copy_(norm.weight)
    xb = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(norm.to(torch.bfloat16)(xb), hf.to(torch.bfloat16)(xb),
                               atol=0, rtol=0)


def test_qkv_and_merged_weight_loaders():
    qkv = QKVLinear(8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    parts = {s: torch.randn(n, 8) for s, n in zip("qkv", (8, 4, 4), strict=True)}
    biases = {s: torch.randn(n) for s, n in zip("qkv", (8, 4, 4), strict=True)}
    for s in "qkv":
        qkv.weight.weight_loader(qkv.weight, parts[s], s)
        qkv.bias.weight_loader(qkv.bias, biases[s], s)
    x = torch.randn(3, 8)
    want = torch.cat([x @ parts[s].T + biases[s] for s in "qkv"], dim=-1)
    torch.testing.assert_close(qkv(x), want)
    assert qkv.weight.shard_ids == ("q", "k", "v")

    merged = MergedLinear(8, [6, 6])
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))
    with pytest.raises(ConfigError, match="does not match"):
        merged.weight.weight_loader(merged.weight, torch.randn(5, 8), 1)


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_builds_under_another_default_device(name):
    # The loader builds models under `with torch.device(...)`; the CPU-side frequency math must
    # not mix devices (meta stands in for CUDA here).
    theta, scaling, max_pos = ROPES[name]
    with torch.device("meta"):
        rope = RotaryEmbedding(64, max_pos, theta, scaling)
    assert rope.cos_sin_cache.device.type == "meta"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_without_a_cache_runs_a_fused_kernel_on_cuda():
    """The no-cache causal attention (the start-up profile's, 8,192 tokens) equals the CPU's
    math kernel and holds no [H, T, T] score matrix: its peak is what the KV budget loses."""
    from skyline.model.layers.attention import Attention

    layer = Attention(8, 64, 0.125, 2)
    g = torch.Generator().manual_seed(0)
    t = 2048
    q, k, v = (torch.randn(t, h, 64, generator=g) for h in (8, 2, 2))
    want = layer._causal(q, k, v)
    dev = [x.cuda().bfloat16() for x in (q, k, v)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = layer._causal(*dev)
    peak = torch.cuda.max_memory_allocated() - base
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
    assert peak < 8 * t * t * 2 // 4  # a quarter of the bf16 scores: none held whole
