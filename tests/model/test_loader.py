"""The loader: format detection and its errors, sharded safetensors, dummy weights from the
shipped configs, and clear errors for unsupported architectures and bad checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyline.config import ConfigError, ModelConfig
from skyline.configs import dummy_config_dir, shipped_config_names
from skyline.model.default import default_model_path
from skyline.model.loader import load_model, read_model_arch
from skyline.model.registry import MODEL_REGISTRY, get_model_class

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=128)


@pytest.fixture(scope="module")
def hf_llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _load(path: str, dtype: str = "float32", load_format: str = "auto"):
    arch, fmt = read_model_arch(path, load_format)
    return load_model(ModelConfig(path, fmt, arch, dtype, max_model_len=128), "cpu")


def _logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_sharded_safetensors(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sky = _load(str(tmp_path))
    ids = [1, 5, 9, 33, 2, 100, 7]
    with torch.no_grad():
        want = hf_llama(torch.tensor([ids])).logits[0]
    got = _logits(sky, ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_shard_listed_in_index_but_missing(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    sorted(tmp_path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(ConfigError, match="which is missing"):
        _load(str(tmp_path))


def _resave_without(path, drop: str | None = None, add: dict | None = None):
    tensors = load_file(path / "model.safetensors")
    if drop:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_weight_is_named(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True)
    _resave_without(tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match=r"lacks 1 weight.*layers\.1\.mlp\.up_proj\.weight"):
        _load(str(tmp_path))


def test_unexpected_weight_is_named(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True)
    _resave_without(tmp_path, add={"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)})
    with pytest.raises(ConfigError, match="o_proj.bias"):
        _load(str(tmp_path))


def test_shape_mismatch_is_named(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True)
    _resave_without(tmp_path, add={"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)})
    with pytest.raises(ConfigError, match=r"k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        _load(str(tmp_path))


def test_truncated_safetensors(hf_llama, tmp_path):
    hf_llama.save_pretrained(tmp_path, safe_serialization=True)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        _load(str(tmp_path))


def test_tied_checkpoint_with_lm_head_is_accepted(tmp_path):
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
    ).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    emb = load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    _resave_without(tmp_path, add={"lm_head.weight": emb.clone()})
    sky = _load(str(tmp_path))
    assert sky.lm_head.weight is sky.model.embed_tokens.weight


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ConfigError, match="architecture GPT2LMHeadModel is not supported; "
                                          "skyline supports: GptOssForCausalLM, "
                                          "LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    config = {**TINY, "num_hidden_layers": 1, "architectures": ["FalconForCausalLM"]}
    config["num_attention_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch, fmt = read_model_arch(str(tmp_path), "dummy")
    with pytest.raises(ConfigError, match="FalconForCausalLM is not supported"):
        load_model(ModelConfig(str(tmp_path), fmt, arch, "float32", 128), "cpu")


def test_registry_is_a_plain_dict():
    assert type(MODEL_REGISTRY) is dict
    assert set(MODEL_REGISTRY) >= {"LlamaForCausalLM", "MistralForCausalLM",
                                   "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_read_model_arch_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_model_arch(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="has no config.json"):
        read_model_arch(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_model_arch(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="lacks the field"):
        read_model_arch(str(tmp_path))
    config = {**TINY, "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no \\*.safetensors weights.*--load-format dummy"):
        read_model_arch(str(tmp_path))
    assert read_model_arch(str(tmp_path), "dummy")[1] == "dummy"
    with pytest.raises(ConfigError, match="needs a .gguf file"):
        read_model_arch(str(tmp_path), "gguf")
    with pytest.raises(ConfigError, match="unknown"):
        read_model_arch(str(tmp_path), "pickle")
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(ConfigError, match="neither a .gguf file nor a directory"):
        read_model_arch(str(tmp_path / "weights.txt"))


def test_transformers5_rope_parameters_are_read(tmp_path):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    config = transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling=scaling)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    arch, _ = read_model_arch(str(tmp_path), "dummy")
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.rope_scaling["factor"] == 8.0


def test_shipped_configs():
    assert shipped_config_names() == ["gpt-oss-20b", "llama-3.1-8b", "qwen3-30b-a3b", "qwen3-8b",
                                      "smollm2-135m"]
    assert dummy_config_dir("no-such-model") is None
    llama, fmt = read_model_arch(dummy_config_dir("llama-3.1-8b"), "dummy")
    assert fmt == "dummy"
    assert (llama.architecture, llama.vocab_size, llama.hidden_size) == (
        "LlamaForCausalLM", 128256, 4096)
    assert (llama.intermediate_size, llama.num_layers, llama.num_heads, llama.num_kv_heads,
            llama.head_dim) == (14336, 32, 32, 8, 128)
    assert llama.rope_theta == 500000.0 and llama.max_position_embeddings == 131072
    assert llama.rope_scaling == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192, rope_type="llama3")
    assert not llama.tie_word_embeddings and llama.rms_norm_eps == 1e-5
    qwen, _ = read_model_arch(dummy_config_dir("qwen3-8b"), "dummy")
    assert (qwen.architecture, qwen.vocab_size, qwen.hidden_size, qwen.intermediate_size) == (
        "Qwen3ForCausalLM", 151936, 4096, 12288)
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (36, 32, 8, 128)
    assert qwen.rope_theta == 1e6 and qwen.max_position_embeddings == 40960
    assert qwen.qk_norm and not qwen.attention_bias and not qwen.tie_word_embeddings
    # a shipped name also works directly with --load-format dummy
    assert read_model_arch("qwen3-8b", "dummy")[0] == qwen
    # smollm2-135m: the embedded default model's shape, in bfloat16
    smol, _ = read_model_arch("smollm2-135m", "dummy")
    assert smol.torch_dtype == "bfloat16"
    try:
        default, _ = read_model_arch(default_model_path(), "gguf")
    except Exception:
        pytest.skip("the default GGUF model is not installed")
    shape = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
             "num_heads", "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings",
             "rms_norm_eps")
    assert [getattr(smol, k) for k in shape] == [getattr(default, k) for k in shape]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_dummy_weights_from_shrunken_shipped_config(name):
    arch, fmt = read_model_arch(dummy_config_dir(name), "dummy")
    small = dataclasses.replace(arch, vocab_size=512, hidden_size=64, intermediate_size=96,
                                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                max_position_embeddings=4096)
    cfg = ModelConfig(name, fmt, small, "bfloat16", max_model_len=4096, seed=7)
    model = load_model(cfg, "cpu")
    for pname, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        if "norm" in pname:
            assert bool((p == 1).all()), pname
        else:
            assert p.abs().max().item() <= 1e-3 and p.std().item() > 1e-4, pname
    logits = _logits(model, [1, 2, 3, 4])
    assert logits.shape == (4, 512) and torch.isfinite(logits).all()
    again = load_model(cfg, "cpu")
    assert torch.equal(_logits(again, [1, 2, 3, 4]), logits)  # seeded


def test_plain_layout_undoes_cpu_prepacking(hf_llama, tmp_path):
    """prepack_for_cpu then plain_layout: the dense weights back as Parameters, bit for bit,
    and the model computes as a freshly loaded one (what tools' queries rely on)."""
    from skyline.model.loader import plain_layout, prepack_for_cpu

    hf_llama.save_pretrained(tmp_path, safe_serialization=True)
    fresh, model = _load(str(tmp_path)), _load(str(tmp_path))
    if not prepack_for_cpu(model, torch.float32):
        pytest.skip("this torch build packs nothing for oneDNN")
    plain_layout(model)
    want, got = dict(fresh.named_parameters()), dict(model.named_parameters())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert model.lm_head.packed_weight is None
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(_logits(model, ids), _logits(fresh, ids))


def test_plain_layout_undoes_the_bf16_kernels_copies(hf_llama, tmp_path, monkeypatch):
    """The same in bfloat16 with the bf16 kernel's plain copies (ops/cpu_bf16.py) and the
    streamed weights in huge pages (ops/host_memory.py): the Parameters back bit for bit, each
    in memory of its own (a checkpoint writer refuses tensors that share it)."""
    import dataclasses

    from skyline.model.loader import plain_layout, prepack_for_cpu
    from skyline.ops import cpu_bf16, cpu_linear, cpu_plan

    if not (cpu_bf16.available() and cpu_linear.can_pack(torch.zeros(1, 1).bfloat16())):
        pytest.skip("needs the bf16 kernel and oneDNN's bfloat16 products")
    plan = dataclasses.replace(cpu_plan.plan(), dtype=torch.bfloat16, bf16_rows=2)
    monkeypatch.setattr(cpu_plan, "plan", lambda: plan)
    hf_llama.save_pretrained(tmp_path, safe_serialization=True)
    fresh, model = _load(str(tmp_path), "bfloat16"), _load(str(tmp_path), "bfloat16")
    prepack_for_cpu(model, torch.bfloat16)
    proj = model.model.layers[0].self_attn.qkv_proj
    assert proj.bf16_weight is not None and model.lm_head.bf16_rows == 2
    assert model.model.cpu_decode_step() != "modules"  # planned on the bf16 kernel's weights
    plain_layout(model)
    assert not hasattr(proj, "bf16_weight") and model.lm_head.bf16_rows == 0
    # the plan held the packed products: planned again, the plain Linears have none
    assert model.model.cpu_decode_step() == "modules"
    want, got = dict(fresh.named_parameters()), dict(model.named_parameters())
    assert all(torch.equal(want[n], got[n]) for n in want)
    for p in got.values():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
