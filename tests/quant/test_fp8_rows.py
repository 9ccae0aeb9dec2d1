"""FP8 decode products fed by their producers: RMSNorm and SiLU-and-mul hand an fp8 Linear its
input already quantized per row (ops/fp8_quant.Fp8Rows) when the Linear's decode GEMV takes it
so (GEMV_ACTIVATIONS "a8p"); the logits are those of quantizing the same rows in the product."""

from __future__ import annotations

import pytest
import torch

from skyline.engine.create import EngineArgs, create_engine_config
from skyline.model.loader import load_model
from skyline.ops import fp8_linear
from skyline.ops.fp8_quant import Fp8Rows
from skyline.quant import fp8

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny_llama_fp8")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def fp8_model(path: str, device: str):
    cfg, _ = create_engine_config(EngineArgs(model=path, dtype="bfloat16", device=device,
                                             quantization="fp8"))
    return load_model(cfg.model, device)


def run(model, device: str, n: int = 3) -> torch.Tensor:
    ids = torch.tensor([(7 * i + 5) % 128 for i in range(n)], device=device)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n, device=device))).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def spy_rows(monkeypatch) -> list[int]:
    """Counts the fp8 GEMV calls that receive Fp8Rows."""
    calls: list[int] = []
    real = fp8_linear.fp8_gemv_a8

    def spy(xq, x_scale, *args, **kw):
        calls.append(int(x_scale is not None))
        return real(xq, x_scale, *args, **kw)

    monkeypatch.setattr(fp8_linear, "fp8_gemv_a8", spy)
    return calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter (CPU machines); "
                    "the CUDA test below covers GPUs")
def test_producers_hand_over_rows_on_the_decode_path(hf_dir, monkeypatch):
    # CPU: the GEMV runs in Triton's interpreter as if the CPU had fp8 units, the producers'
    # references make the rows. Against every Linear quantizing its own input per row ("a8q",
    # the same reference), qkv, gate/up and down get the same rows; o_proj quantizes in its
    # GEMV per row and K tile under "a8p", here one tile (K = 64): the same rows again, so
    # the logits are equal.
    decode = lambda x: x.dtype == torch.bfloat16 and x.dim() == 2 and len(x) <= 8  # noqa: E731
    monkeypatch.setattr(fp8_linear, "quant_gemv_ok", decode)
    monkeypatch.setattr(fp8_linear, "has_fp8_units", lambda device: True)
    monkeypatch.setattr(fp8, "fp8_gemv_takes_rows", decode)
    model = fp8_model(hf_dir, "cpu")
    monkeypatch.setattr(fp8, "GEMV_ACTIVATIONS", "a8q")
    want = run(model, "cpu")
    monkeypatch.setattr(fp8, "GEMV_ACTIVATIONS", "a8p")
    calls = spy_rows(monkeypatch)
    got = run(model, "cpu")
    # per layer: qkv (input norm), gate/up (post-attention norm), down (SiLU-and-mul) take
    # rows; o_proj (attention output) quantizes in its GEMV
    assert sum(calls) == 3 * 2 and len(calls) == 4 * 2
    assert torch.equal(got, want)
    monkeypatch.setattr(fp8, "GEMV_ACTIVATIONS", "a8")  # only "a8p" asks the producers
    calls.clear()
    run(model, "cpu")
    assert len(calls) == 4 * 2 and not any(calls)


def test_rows_type_carries_the_output_dtype():
    rows = Fp8Rows(torch.zeros(2, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 1), torch.float16)
    w = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    if not torch.cuda.is_available():
        pytest.skip("the Fp8Rows product is the CUDA GEMV's")
    y = fp8_linear.fp8_linear(Fp8Rows(rows.q.cuda(), rows.scale.cuda(), rows.dtype), w.cuda(),
                              torch.ones(3, device="cuda"))
    assert y.dtype == torch.float16 and y.shape == (2, 3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_takes_rows_from_producers(hf_dir, monkeypatch):
    # On the GPU the norm / SiLU kernels quantize; the same model with every Linear quantizing
    # its own input ("a8q", the per-row kernel) gives the same rows to qkv, gate/up and down.
    model = fp8_model(hf_dir, "cuda")
    monkeypatch.setattr(fp8, "GEMV_ACTIVATIONS", "a8q")
    want = run(model, "cuda")
    monkeypatch.setattr(fp8, "GEMV_ACTIVATIONS", "a8p")
    calls = spy_rows(monkeypatch)
    got = run(model, "cuda")
    assert sum(calls) == 3 * 2 and len(calls) == 4 * 2  # o_proj quantizes in its GEMV
    assert rel_err(got, want) < 2e-2
    prefill = run(model, "cuda", n=40)  # past the GEMV's rows: _scaled_mm, no Fp8Rows
    assert torch.isfinite(prefill).all() and len(calls) == 4 * 2
