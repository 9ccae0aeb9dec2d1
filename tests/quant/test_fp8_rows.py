"""FP8 products fed by their producers: RMSNorm and SiLU-and-mul hand an fp8 Linear its input
already quantized per row (ops/fp8_quant.Fp8Rows), for the decode GEMV and for torch._scaled_mm
above its rows; the logits are those of quantizing the same rows in the product."""

from __future__ import annotations

import pytest
import torch

from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.model.loader import load_model
from skyline.ops import fp8_linear
from skyline.quant import fp8

pytest.importorskip("triton")
pytest.importorskip("transformers")


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


def own_then_handed(model, device: str, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Decode logits with every Linear quantizing its own input (per row and K tile in the
    GEMV: per row here, every K within one tile), then with the producers handing over rows,
    and the fp8 GEMV calls of the second run (1 for a call that received Fp8Rows, 0 for one
    that quantized x itself)."""
    takes_rows = fp8.fp8_takes_rows
    monkeypatch.setattr(fp8, "fp8_takes_rows", lambda x, w: False)  # no Linear asks
    want = run(model, device)
    monkeypatch.setattr(fp8, "fp8_takes_rows", takes_rows)
    calls: list[int] = []
    real = fp8_linear.fp8_gemv_a8

    def spy(xq, x_scale, *args, **kw):
        calls.append(int(x_scale is not None))
        return real(xq, x_scale, *args, **kw)

    monkeypatch.setattr(fp8_linear, "fp8_gemv_a8", spy)
    return want, run(model, device), calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter (CPU machines); "
                    "the CUDA test below covers GPUs")
def test_producers_hand_over_rows_on_the_decode_path(tiny_llama_dir, monkeypatch):
    # CPU: the GEMV runs in Triton's interpreter as if the CPU had fp8 units, the producers'
    # references make the rows. Against every Linear quantizing its own input in its GEMV (per
    # row and K tile, here one tile: K = 64 and 96), qkv and gate/up get the same rows, and so
    # does down (SiLU's 1,024-column scale blocks span its 96 columns); o_proj quantizes in its
    # GEMV either way, so the logits are equal.
    decode = lambda x: x.dtype == torch.bfloat16 and x.dim() == 2 and len(x) <= 8  # noqa: E731
    monkeypatch.setattr(fp8_linear, "quant_gemv_ok", decode)
    monkeypatch.setattr(fp8_linear, "has_fp8_units", lambda device: True)
    monkeypatch.setattr(fp8, "fp8_takes_rows", lambda x, w: decode(x))
    model = fp8_model(tiny_llama_dir, "cpu")
    want, got, calls = own_then_handed(model, "cpu", monkeypatch)
    # per layer: qkv (input norm), gate/up (post-attention norm), down (SiLU-and-mul) take
    # rows; o_proj (attention output) quantizes in its GEMV
    assert sum(calls) == 3 * 2 and len(calls) == 4 * 2
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_takes_rows_from_producers(tiny_llama_dir, monkeypatch):
    # On the GPU the norm / SiLU kernels quantize; against every Linear quantizing its own input
    # in its GEMV, qkv and gate/up get the same rows, down finer-scaled ones.
    model = fp8_model(tiny_llama_dir, "cuda")
    want, got, calls = own_then_handed(model, "cuda", monkeypatch)
    assert sum(calls) == 3 * 2 and len(calls) == 4 * 2  # o_proj quantizes in its GEMV
    assert rel_err(got, want) < 2e-2
    prefill = run(model, "cuda", n=40)  # past the GEMV's rows: _scaled_mm, Fp8Rows per row
    assert torch.isfinite(prefill).all() and len(calls) == 4 * 2


def test_producers_hand_over_rows_past_the_gemv(tiny_llama_dir, monkeypatch):
    # 12 rows, more than the GEMV takes: the norms and SiLU-and-mul hand over one scale per row
    # (torch._scaled_mm's; its float32 emulation on the CPU), the bytes quantize_rows_fp8 makes
    # of the same rows, so only o_proj (fed by attention) still quantizes its input itself and
    # the logits are equal.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = fp8_model(tiny_llama_dir, device)
    takes_rows = fp8.fp8_takes_rows
    monkeypatch.setattr(fp8, "fp8_takes_rows", lambda x, w: False)
    want = run(model, device, n=12)
    if device == "cpu":  # as a GPU with fp8 units would ask
        takes_rows = lambda x, w: x.dim() == 2 and x.dtype == torch.bfloat16  # noqa: E731
    monkeypatch.setattr(fp8, "fp8_takes_rows", takes_rows)
    own: list[int] = []
    real = fp8_linear.quantize_rows_fp8
    monkeypatch.setattr(fp8_linear, "quantize_rows_fp8", lambda x: own.append(1) or real(x))
    got = run(model, device, n=12)
    assert len(own) == 2  # one o_proj a layer
    assert torch.equal(got, want)
