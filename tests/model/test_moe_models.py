"""Mixture-of-experts models beyond the HF parity cases: gpt-oss checkpoints with MXFP4 experts
as shipped (against HF with the same experts dequantized), experts quantized while loading,
the shipped Qwen3-30B-A3B and gpt-oss-20b configs (full size on the meta device; dummy weights
shrunk), and the errors an MoE checkpoint or format can cause."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_parity import GPT_OSS_ROPE, greedy_matches_hf, hf_logits, rel_err

from skyline.config import ConfigError, ModelArch, ModelConfig
from skyline.configs import dummy_config_dir
from skyline.engine.cost import model_cost
from skyline.model.layers.moe import FusedExperts
from skyline.model.loader import load_model, read_model_arch
from skyline.quant.experts import Fp8ExpertMethod, Mxfp4ExpertMethod
from skyline.quant.fp4 import dequantize_mxfp4, quantize_mxfp4
from skyline.quant.resolve import resolve_quant_config

transformers = pytest.importorskip("transformers")

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5)


def randomized(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    return model.eval()


def load(path: str, quantization: str | None = None, dtype: str = "float32"):
    arch, fmt = read_model_arch(path)
    quant = resolve_quant_config(quantization, 128, path, fmt)
    return load_model(ModelConfig(path, fmt, arch, dtype, 256, quant=quant), "cpu")


def mxfp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, rows, K] -> (blocks [E, rows, K / 32, 16], scales [E, rows, K / 32], the
    dequantized weight [E, rows, K])."""
    e, n, k = w.shape
    codes, scales = quantize_mxfp4(w.reshape(e * n, k))
    deq = dequantize_mxfp4(codes, scales).view(e, n, k)
    return codes.view(e, n, k // 32, 16), scales.view(e, n, k // 32), deq


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """A tiny gpt-oss checkpoint whose experts are stored as gpt-oss ships them (MXFP4 blocks
    and scales, rows = outputs, gate and up interleaved), and the HF model holding the same
    experts dequantized."""
    torch.manual_seed(0)
    # YaRN consistent with the small context (the default's factor 32 over 4,096 positions
    # is read differently by transformers releases when max_position_embeddings is 256)
    cfg = transformers.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=8, swiglu_limit=0.5,
                                    rope_parameters=GPT_OSS_ROPE)
    hf = randomized(transformers.GptOssForCausalLM(cfg))
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf.save_pretrained(path, safe_serialization=True)
    state = {k: v.clone() for k, v in hf.state_dict().items()}  # gpt-oss's own names
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            stacked = getattr(layer.mlp.experts, proj).data  # [E, in, out]
            blocks, scales, deq = mxfp4_rows(stacked.transpose(1, 2).contiguous())
            stacked.copy_(deq.transpose(1, 2))
            del state[name]
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return str(path), hf


def test_gpt_oss_mxfp4_checkpoint_matches_hf(gpt_oss_mxfp4):
    path, hf = gpt_oss_mxfp4
    sky = load(path)
    experts = [m for m in sky.modules() if isinstance(m, FusedExperts)]
    assert all(isinstance(m.expert_method, Mxfp4ExpertMethod) for m in experts)
    assert experts[0].w13_blocks.dtype == torch.uint8 and not hasattr(experts[0], "w13")
    ids = torch.randint(0, VOCAB, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        logits = sky.compute_logits(sky(torch.tensor(ids), torch.arange(len(ids))))
    assert rel_err(logits, hf_logits(hf, ids)) < 1e-4
    greedy_matches_hf(hf, sky, ids[:9], 8, block_size=4)  # past the sliding window


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, norm_topk_prob=True)
    hf = randomized(transformers.Qwen3MoeForCausalLM(cfg))
    path = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


@pytest.mark.parametrize("fmt,method,tol", [("fp8", Fp8ExpertMethod, 0.05),
                                            ("mxfp4", Mxfp4ExpertMethod, 0.2)])
def test_experts_quantized_while_loading(qwen3_moe, fmt, method, tol):
    """Every expert's weights, read back from the format, are the checkpoint's within the
    format's rounding; the model runs."""
    path, _ = qwen3_moe
    dense, sky = load(path), load(path, fmt)
    pairs = [(a, b) for a, b in zip(dense.modules(), sky.modules(), strict=True)
             if isinstance(a, FusedExperts)]
    assert pairs and all(isinstance(b.expert_method, method) for _, b in pairs)
    for a, b in pairs:
        for want, got in zip(a.expert_method.weights(a), b.expert_method.weights(b),
                             strict=True):
            for e in range(a.num_experts):
                assert rel_err(got.expert(e, torch.float32), want.weight[e]) < tol
    ids = list(range(5, 60, 3))
    with torch.no_grad():
        logits = sky.compute_logits(sky(torch.tensor(ids), torch.arange(len(ids))))
    assert torch.isfinite(logits).all()


def test_formats_without_an_moe_kernel_are_refused(qwen3_moe):
    path, _ = qwen3_moe
    with pytest.raises(ConfigError, match="mixture-of-experts weights can be none, fp8, mxfp4"):
        load(path, "int4")


def test_missing_expert_weight_is_named(qwen3_moe, tmp_path):
    path, _ = qwen3_moe
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(f"{path}/config.json").read())
    with pytest.raises(ConfigError, match=r"lacks 1 weight.*model\.layers\.1\.mlp\.experts\.5\."
                                          r"up_proj\.weight"):
        load(str(tmp_path))


def test_bad_moe_configs():
    base = {"architectures": ["MixtralForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2}
    with pytest.raises(ConfigError, match="routes each token to 3 of 2 experts"):
        ModelArch.from_hf_config(base | {"num_local_experts": 2, "num_experts_per_tok": 3})
    with pytest.raises(ConfigError, match="one type per layer"):
        ModelArch.from_hf_config(base | {"sliding_window": 4, "layer_types": ["full_attention"]})
    with pytest.raises(ConfigError, match="chunked_attention"):
        ModelArch.from_hf_config(base | {"sliding_window": 4,
                                         "layer_types": ["chunked_attention"] * 2})
    arch = ModelArch.from_hf_config(base | {"num_local_experts": 4, "num_experts_per_tok": 2,
                                            "sliding_window": 4})
    assert arch.sliding_windows == (4, 4) and arch.moe_intermediate_size == 8
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4,
            "max_window_layers": 1}
    assert ModelArch.from_hf_config(qwen | {"use_sliding_window": False}).sliding_windows == ()
    assert ModelArch.from_hf_config(qwen | {"use_sliding_window": True}).sliding_windows == (0, 4)


def test_shipped_moe_configs():
    qwen, fmt = read_model_arch(dummy_config_dir("qwen3-30b-a3b"), "dummy")
    assert fmt == "dummy" and qwen.architecture == "Qwen3MoeForCausalLM"
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads) == (
        2048, 48, 32, 4)
    assert qwen.norm_topk_prob and qwen.dense_layers == () and qwen.sliding_windows == ()
    oss, _ = read_model_arch(dummy_config_dir("gpt-oss-20b"), "dummy")
    assert (oss.num_experts, oss.num_experts_per_tok, oss.hidden_size, oss.head_dim) == (
        32, 4, 2880, 64)
    assert oss.sliding_windows == (128, 0) * 12 and oss.swiglu_limit == 7.0
    assert oss.rope_scaling["rope_type"] == "yarn" and oss.attention_bias
    quant = resolve_quant_config(None, 128, dummy_config_dir("gpt-oss-20b"), "dummy")
    assert (quant.method, quant.experts, quant.experts_prequantized) == ("none", "mxfp4", True)
    # the dense products the kernel tuners measure: the router, no dense MLP
    assert qwen.layer_linears() == {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)}
    assert oss.layer_linears() == {"qkv": (5120, 2880), "o": (2880, 4096), "router": (32, 2880)}
    mixed = dataclasses.replace(qwen, dense_layers=(0,), intermediate_size=6144)
    assert mixed.layer_linears()["gate_up"] == (12288, 2048)


def test_full_size_moe_costs():
    """Both shipped MoE models built at full size (meta device): active parameters per token
    and the bytes a batch-1 decode step reads (only its experts)."""
    qwen = model_cost("qwen3-30b-a3b")
    assert 3.0e9 < qwen.linear_params + qwen.head_params < 3.1e9  # "A3B", embedding aside
    assert qwen.expert_fraction == 8 / 128
    assert abs(qwen.weight_bytes - 2 * (qwen.linear_params + qwen.head_params)) < 1e6
    assert 57e9 < qwen.expert_bytes < 58.5e9
    assert qwen.step_weight_bytes(1) == qwen.weight_bytes
    assert qwen.step_weight_bytes(10_000) == pytest.approx(qwen.weight_bytes + qwen.expert_bytes
                                                            * (1 - 8 / 128), rel=1e-6)
    oss = model_cost("gpt-oss-20b")  # MXFP4 experts: 4.25 bits a weight
    experts = 24 * 32 * 3 * 2880 * 2880
    assert oss.expert_bytes == pytest.approx(experts * 17 / 32 + 24 * 32 * 3 * 2880 * 2, rel=1e-3)
    assert 3.55e9 < oss.linear_params + oss.head_params < 3.65e9  # 3.6B active


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_dummy_weights_from_shrunken_moe_config(name):
    path = dummy_config_dir(name)
    arch, fmt = read_model_arch(path, "dummy")
    small = dataclasses.replace(arch, vocab_size=512, hidden_size=64, intermediate_size=96,
                                moe_intermediate_size=64, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=16, num_experts=8,
                                sliding_windows=arch.sliding_windows[:2])
    cfg = ModelConfig(path, fmt, small, "bfloat16", max_model_len=512, seed=3,
                      quant=resolve_quant_config(None, 128, path, fmt))
    model = load_model(cfg, "cpu")
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert len(experts) == 2
    if name == "gpt-oss-20b":
        assert experts[0].w13_blocks.dtype == torch.uint8
        assert int(experts[0].w2_scales.min()) == int(experts[0].w2_scales.max()) == 117
    ids = torch.tensor([1, 2, 3, 4, 5])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(5)))
        again = load_model(cfg, "cpu")
        assert torch.equal(again.compute_logits(again(ids, torch.arange(5))), logits)
    assert logits.shape == (5, 512) and torch.isfinite(logits).all()
