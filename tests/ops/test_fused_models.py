"""The fused kernels inside whole models: tiny random-weight Llama (Llama-3 rope) and Qwen3 (q/k
norm fused with rope) against Hugging Face logits. On CPU the layers are pointed at the Triton
kernels (run by Triton's interpreter), so the in-place wiring is checked without a GPU; on CUDA
the layers' own dispatch picks the kernels."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")

import skyline.model.layers.mlp as mlp_layer  # noqa: E402
import skyline.model.layers.norm as norm_layer  # noqa: E402
import skyline.model.layers.rotary as rotary_layer  # noqa: E402
import skyline.model.qwen3 as qwen3_model  # noqa: E402
from skyline.config import ModelConfig  # noqa: E402
from skyline.model.loader import load_model, read_model_arch  # noqa: E402
from skyline.ops.activation import silu_and_mul_fp8_triton, silu_and_mul_triton  # noqa: E402
from skyline.ops.norm import fused_add_rms_norm_triton, rms_norm_triton  # noqa: E402
from skyline.ops.rotary import rotary_triton  # noqa: E402

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256, rms_norm_eps=1e-5)
CASES = {
    "llama_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))),
    "qwen3_qknorm": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def hf_dir(request, tmp_path_factory):
    config_name, model_name, extra = CASES[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(getattr(transformers, config_name)(**SMALL, **extra))
    with torch.no_grad():  # norm weights away from 1, so a norm that skips its weight shows
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    path = tmp_path_factory.mktemp(request.param)
    hf.eval().save_pretrained(path, safe_serialization=True)
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    return str(path), ids, want


def skyline_logits(path: str, ids: torch.Tensor, device: str, dtype: str) -> torch.Tensor:
    arch, fmt = read_model_arch(path)
    model = load_model(ModelConfig(path=path, load_format=fmt, arch=arch, dtype=dtype,
                                   max_model_len=256), device)
    with torch.inference_mode():
        hidden = model(ids.to(device), torch.arange(len(ids), device=device))
        return model.compute_logits(hidden).cpu()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU-only machines")
def test_kernels_in_the_model_match_hf_on_cpu(hf_dir, monkeypatch):
    path, ids, want = hf_dir
    monkeypatch.setattr(norm_layer, "rms_norm", rms_norm_triton)
    monkeypatch.setattr(norm_layer, "fused_add_rms_norm", fused_add_rms_norm_triton)
    monkeypatch.setattr(rotary_layer, "rotary_embedding", rotary_triton)
    monkeypatch.setattr(qwen3_model, "qk_norm_rotary", rotary_triton)
    monkeypatch.setattr(mlp_layer, "silu_and_mul", lambda x, quant=None: (
        silu_and_mul_fp8_triton(x) if quant == "fp8" else silu_and_mul_triton(x)))
    assert rel_err(skyline_logits(path, ids, "cpu", "float32"), want) < 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_model_matches_hf(hf_dir, monkeypatch):
    path, ids, want = hf_dir
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    assert rel_err(skyline_logits(path, ids, "cuda", "float32"), want) < 1e-4
    assert rel_err(skyline_logits(path, ids, "cuda", "bfloat16"), want) < 5e-2
