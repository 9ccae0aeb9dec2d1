"""model/gguf.py: GGUF metadata -> HF config, GGUF tensors -> HF weights.

Synthetic files are written from tiny random transformers models the way llama.cpp's converter
writes them (Q/K rows permuted for llama); the default model is checked against transformers'
own GGUF loader.
"""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from skyline.config import ConfigError, ModelArch, ModelConfig, QuantConfig
from skyline.model.default import default_model_path
from skyline.model.gguf import (
    head_code_bits,
    hf_weight_name,
    iter_gguf_weights,
    read_gguf_hf_config,
)
from skyline.model.gguf_rope import llama3_scaling_from_factors

transformers = pytest.importorskip("transformers")

GGUF_LAYER = {v: k for k, v in {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}.items()}
GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def default_model() -> str:
    """The embedded default model's file; the test is skipped where it is not installed."""
    try:
        return default_model_path()
    except ConfigError:
        pytest.skip("the default GGUF model is not installed")


def gguf_name(hf: str) -> str:
    if hf in GGUF_GLOBAL:
        return GGUF_GLOBAL[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_LAYER[module]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved rows)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def tiny_model(arch: str, tie: bool = False) -> torch.nn.Module:
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **kw))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def write_header(w: GGUFWriter, c, head_dim: bool) -> None:
    """The shape metadata and a stand-in vocabulary of HF config `c`, as llama.cpp's converter
    writes them (`head_dim`: the key and value lengths too)."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    if head_dim:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])


def write_gguf(path: str, model: torch.nn.Module, arch: str, quant: bool = False,
               extra: dict | None = None) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would; returns the HF weights as the file holds them."""
    c = model.config
    w = GGUFWriter(path, arch)
    write_header(w, c, head_dim=arch == "qwen3")
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for add in (extra or {}).values():
        add(w)
    expected = {}
    for name, t in model.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = t.numpy().astype(np.float32)
        stored = a
        if arch == "llama" and name.endswith("q_proj.weight"):
            stored = permute(a, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            stored = permute(a, c.num_key_value_heads)
        if quant and a.ndim == 2:
            qtype = Q.Q8_0 if "embed" in name else Q.Q5_1 if "mlp" in name else Q.Q4_0
            data = quantize(stored, qtype)
            w.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            a = dequantize(data, qtype)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
                a = unpermute_np(a, heads)  # what the loader must give back
        else:
            w.add_tensor(gguf_name(name), stored)
        expected[name] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def unpermute_np(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant", [False, True], ids=["f32", "quant"])
def test_synthetic_roundtrip(tmp_path, arch: str, quant: bool) -> None:
    model = tiny_model(arch, tie=quant)
    path = str(tmp_path / f"{arch}.gguf")
    expected = write_gguf(path, model, arch, quant=quant)
    cfg = read_gguf_hf_config(path)
    hf = model.config.to_dict()
    hf["architectures"] = [type(model).__name__]
    hf["rope_theta"] = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta"))
    want = ModelArch.from_hf_config(hf)
    got = ModelArch.from_hf_config(cfg)
    assert got.architecture == want.architecture
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "max_position_embeddings", "tie_word_embeddings", "attention_bias", "qk_norm"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.bos_token_id == 1 and got.eos_token_ids == (2,) and cfg["rope_scaling"] is None
    assert head_code_bits(path) == 8  # the head is float32, or the tied embedding in Q8_0
    weights = dict(iter_gguf_weights(path, got))
    assert set(weights) == set(expected)
    for name, a in expected.items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], torch.from_numpy(np.ascontiguousarray(a))), name
    if not quant:  # exact weights: the HF state dict itself
        sd = {k: v for k, v in model.state_dict().items() if k in weights}
        assert all(torch.equal(weights[k], v) for k, v in sd.items())


def test_head_codes_follow_the_file(tmp_path) -> None:
    """A CPU engine holds a GGUF head for the integer dot kernel in 6-bit codes where the file
    stores it in 6 bits or fewer (here Q4_0), else in 8 (the default model's Q8_0 embedding)."""
    from skyline.model.layers.embedding import LMHead
    from skyline.model.loader import load_model, prepack_for_cpu, read_model_arch
    from skyline.ops import cpu_intdot

    path = str(tmp_path / "llama-q.gguf")
    write_gguf(path, tiny_model("llama"), "llama", quant=True)  # lm_head in Q4_0
    assert head_code_bits(path) == 6 and head_code_bits(default_model()) == 8
    arch, fmt = read_model_arch(path)
    model = load_model(ModelConfig(path, fmt, arch, "float32", 64,
                                   quant=QuantConfig(method="gguf")), "cpu")
    head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert head.code_bits == 6
    prepack_for_cpu(model, torch.float32)
    if cpu_intdot.available() and head.intdot_rows:
        assert head.intdot_weight.bits == 6


def test_a_gguf_head_is_held_the_same_whatever_the_linears_became(tmp_path) -> None:
    """The CPU stage of a GPU + CPU placement loads a GGUF file with dequantized Linears (its
    engine resolves formats for the GPU): its head takes the integer dot kernel as a CPU
    engine's does. Float32 of dequantized blocks (--dtype float32) stays exact, and a head that
    is not a GGUF file's never takes codes."""
    from skyline.model.layers.embedding import LMHead
    from skyline.model.loader import load_model, prepack_for_cpu, read_model_arch
    from skyline.ops import cpu_intdot, cpu_plan

    if not cpu_intdot.available() or not cpu_plan.plan().intdot_rows:
        pytest.skip("this CPU's plan runs no integer dot kernel")
    path = str(tmp_path / "llama.gguf")
    write_gguf(path, tiny_model("llama"), "llama")
    arch, fmt = read_model_arch(path)

    def head(dtype: str, load_format: str = fmt) -> LMHead:
        model = load_model(ModelConfig(path, load_format, arch, dtype, 64), "cpu")
        prepack_for_cpu(model, getattr(torch, dtype))
        return next(m for m in model.modules() if isinstance(m, LMHead))

    bf16 = head("bfloat16")
    assert bf16.intdot_weight is not None and bf16.intdot_weight.bits == 8
    assert bf16.intdot_rows == cpu_plan.plan().intdot_rows
    assert head("float32").intdot_weight is None
    dummy = head("bfloat16", "dummy")
    assert dummy.code_bits == 0 and dummy.intdot_weight is None


def test_default_model_matches_transformers_loader() -> None:
    """Names, unpermuted Q/K and dequantized values equal transformers' GGUF loader's."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model()
    cfg = read_gguf_hf_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"]) == (576, 30, 9, 3, 64)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(hf_cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf_model)
    meta = ref["config"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert cfg[key] == meta[key], key
    assert math.isclose(cfg["rms_norm_eps"], meta["rms_norm_eps"], rel_tol=1e-6)
    ref = ref["tensors"]
    ours = dict(iter_gguf_weights(path, ModelArch.from_hf_config(cfg)))
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].shape == t.shape and torch.equal(ours[name], t), name


def llama3_factors(theta: float, dim: int, factor: float, low: float, high: float,
                   orig: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel: the rope_freqs tensor for llama3 scaling
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("theta,dim,factor,orig,high", [
    (500000.0, 128, 8.0, 8192, 4.0),  # Llama 3.1 8B
    (500000.0, 64, 32.0, 8192, 4.0),  # Llama 3.2 1B
    (500000.0, 128, 16.0, 4096, 2.0),
])
def test_llama3_rope_from_factors(theta, dim, factor, orig, high) -> None:
    got = llama3_scaling_from_factors(llama3_factors(theta, dim, factor, 1.0, high, orig),
                                      theta, dim)
    assert got == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                   "high_freq_factor": high, "original_max_position_embeddings": orig}
    assert llama3_scaling_from_factors(np.ones(dim // 2), theta, dim) is None
    odd = np.linspace(1, factor, dim // 2) ** 2  # not llama3-shaped: passed through as factors
    assert llama3_scaling_from_factors(odd, theta, dim)["rope_type"] == "freq_factors"


def test_rope_scaling_metadata(tmp_path) -> None:
    model = tiny_model("llama")
    path = str(tmp_path / "freqs.gguf")
    factors = llama3_factors(10000.0, 16, 8.0, 1.0, 4.0, 64)  # head_dim 16
    extra = {"freqs": lambda w: w.add_tensor("rope_freqs.weight", factors)}
    write_gguf(path, model, "llama", extra=extra)
    scaling = read_gguf_hf_config(path)["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(path, ModelArch.from_hf_config(
        read_gguf_hf_config(path))))
    path = str(tmp_path / "yarn.gguf")
    write_gguf(path, tiny_model("qwen2"), "qwen2", extra={
        "t": lambda w: w.add_rope_scaling_type(RopeScalingType.YARN),
        "f": lambda w: w.add_rope_scaling_factor(4.0),
        "o": lambda w: w.add_rope_scaling_orig_ctx_len(32768),
    })
    assert read_gguf_hf_config(path)["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    path = str(tmp_path / "linear.gguf")
    write_gguf(path, tiny_model("llama"), "llama", extra={
        "t": lambda w: w.add_rope_scaling_type(RopeScalingType.LINEAR),
        "f": lambda w: w.add_rope_scaling_factor(2.0),
    })
    assert read_gguf_hf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_gguf_hf_config(str(tmp_path / "missing.gguf"))
    text = tmp_path / "model.gguf"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_gguf_hf_config(str(text))
    half = tmp_path / "half.gguf"
    source = default_model()
    size = os.path.getsize(source)
    with open(source, "rb") as src, open(half, "wb") as dst:
        dst.write(src.read(size // 2))
    with pytest.raises(ConfigError, match="truncated") as e:
        read_gguf_hf_config(str(half))
    assert "\n" not in str(e.value)
    head = tmp_path / "head.gguf"
    with open(source, "rb") as src, open(head, "wb") as dst:
        dst.write(src.read(1000))
    with pytest.raises(ConfigError, match="truncated"):
        read_gguf_hf_config(str(head))


def test_unsupported_arch_and_type(tmp_path) -> None:
    path = str(tmp_path / "gemma.gguf")
    w = GGUFWriter(path, "gemma")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="'gemma'.*llama, qwen2, qwen3"):
        read_gguf_hf_config(path)
    path = str(tmp_path / "iq.gguf")
    write_gguf(path, tiny_model("llama"), "llama", extra={
        "iq": lambda w: w.add_tensor("blk.0.extra.weight", np.zeros((1, 66), np.uint8),
                                     raw_dtype=Q.IQ2_XXS)})
    with pytest.raises(ConfigError, match="IQ2_XXS.*Q4_K"):
        read_gguf_hf_config(path)


def test_weight_names() -> None:
    assert hf_weight_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_weight_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_weight_name("rope_freqs.weight") is None
    # stacked experts: one name per expert (tests/model/test_gguf_moe.py)
    assert hf_weight_name("blk.0.ffn_gate_exps.weight") == \
        "model.layers.0.mlp.experts.{e}.gate_proj.weight"
    with pytest.raises(ConfigError, match="ffn_frobnicate"):
        hf_weight_name("blk.0.ffn_frobnicate.weight")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_gguf_on_cuda_matches_dense(tmp_path, dtype) -> None:
    """--quantization gguf on CUDA: Q4_0 / Q5_1 / Q8_0 layers in the integer layout of the GPU
    kernels (GEMV for a few tokens, dequant-matmul for more) give the dense model's logits."""
    from skyline.engine.args import EngineArgs
    from skyline.engine.create import create_engine_config
    from skyline.model.loader import load_model

    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, tiny_model("llama", tie=True), "llama", quant=True)

    def run(quantization: str | None, n: int) -> tuple[torch.Tensor, torch.nn.Module]:
        cfg, _ = create_engine_config(EngineArgs(model=path, dtype=dtype, device="cuda",
                                                 quantization=quantization))
        model = load_model(cfg.model, "cuda")
        ids = torch.arange(3, 3 + n, device="cuda") % 96
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(n, device="cuda"))), model

    for n in (3, 40):  # the GEMV's rows, then the dequant-matmul's
        dense, _ = run(None, n)
        packed, model = run("gguf", n)
        layer = model.model.layers[0].mlp.gate_up_proj
        assert layer.gguf_qweight.dtype == torch.uint8 and not hasattr(layer, "gguf_w0")
        err = ((packed - dense).norm() / dense.norm()).item()
        assert err < (1e-5 if dtype == "float32" else 3e-2), (n, err)
