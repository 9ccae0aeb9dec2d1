"""INT4 decode products fed by their producers: RMSNorm and SiLU-and-mul hand an INT4 Linear its
input already rounded to int8 per 32 columns (ops/gemv_int_a8.Int8Chunks) when its W4A8 GEMV
takes it so; the logits are those of rounding the same rows in the GEMV's own launch. CPU
machines: the GEMV and the rounding run in Triton's interpreter, the producers' references make
the chunks."""

from __future__ import annotations

import pytest
import torch

from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.model.loader import load_model
from skyline.ops.gemv_int_a8 import Int8Chunks
from skyline.quant import intq

pytest.importorskip("triton")
pytest.importorskip("transformers")


def run(model, n: int = 3) -> torch.Tensor:
    ids = torch.tensor([(7 * i + 5) % 128 for i in range(n)])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n))).float()


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter (CPU machines)")
def test_producers_hand_over_int8_chunks_on_the_decode_path(tiny_llama_dir, monkeypatch):
    # bf16 rows of at most 8 count as a decode batch on this CPU, as on a GPU
    decode = lambda x: x.dtype == torch.bfloat16 and x.dim() == 2 and len(x) <= 8  # noqa: E731
    monkeypatch.setattr(intq, "quant_gemv_ok", decode)
    cfg, _ = create_engine_config(EngineArgs(model=tiny_llama_dir, dtype="bfloat16", device="cpu",
                                             quantization="int4", quant_group_size=32))
    model = load_model(cfg.model, "cpu")
    calls: list[int] = []  # per W4A8 GEMV call: 1 if it received Int8Chunks
    real = intq.int4_gemv_a8

    def spy(x, *args, **kw):
        calls.append(int(isinstance(x, Int8Chunks)))
        return real(x, *args, **kw)

    monkeypatch.setattr(intq, "int4_gemv_a8", spy)
    with monkeypatch.context() as m:  # no Linear asks its producer: every GEMV rounds x
        m.setattr(intq.IntLinearMethod, "input_quant", lambda self, layer, x: None)
        want = run(model)
    assert calls == [0] * 4 * 2
    calls.clear()
    got = run(model)
    # per layer: qkv (input norm), gate/up (post-attention norm), down (SiLU-and-mul) take
    # chunks; o_proj rounds in its own launch (attention without a paged cache: no combine)
    assert sum(calls) == 3 * 2 and len(calls) == 4 * 2
    assert torch.equal(got, want)
