"""The default model as a CPU engine serves it with no flags (ops/cpu_plan.py: the int4 kernel
for decode-sized batches, dense products above) stays as close to the exact float32 model as
the dense bfloat16 model is, on each plan this machine can run, for prefill-sized and
decode-sized batches."""

from __future__ import annotations

import pytest
import torch

from skyline.config import ConfigError
from skyline.engine.create import EngineArgs, create_engine_config
from skyline.model.cost import ModelCost
from skyline.model.loader import load_model, prepack_for_cpu
from skyline.ops import cpu_linear, cpu_plan

IDS = torch.tensor([(17 * i + 3) % 4000 + 100 for i in range(40)])


def _model(**kw):
    try:
        cfg, _ = create_engine_config(EngineArgs(device="cpu", **kw))
    except ConfigError:
        pytest.skip("the default GGUF model is not installed")
    model = load_model(cfg.model, "cpu")
    prepack_for_cpu(model, getattr(torch, cfg.model.dtype))
    return model


def _logits(model, rows: int) -> torch.Tensor:
    """The logits of IDS computed `rows` tokens at a time (no KV cache: each chunk attends to
    itself only, the same for every model compared)."""
    with torch.no_grad():
        out = [model.compute_logits(model(IDS[s : s + rows], torch.arange(s, s + len(
            IDS[s : s + rows])))).float() for s in range(0, len(IDS), rows)]
    return torch.cat(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


AVX512_VNNI = cpu_plan.CpuCaps("AVX512", avx512_bf16=False, amx_bf16=False, onednn_bf16=True)


@pytest.mark.parametrize("caps", [None, AVX512_VNNI], ids=["this-cpu", "avx512-no-bf16"])
def test_served_default_is_as_close_as_dense_bf16(monkeypatch, caps):
    if caps is not None:
        monkeypatch.setattr(cpu_plan, "probe", lambda: caps)
    plan = cpu_plan.plan()
    if plan.dtype == torch.bfloat16 and not cpu_linear.can_pack(
            torch.zeros(1, 1, dtype=torch.bfloat16)):
        pytest.skip("no oneDNN bfloat16 products here")
    exact = _model(dtype="float32")
    served = _model()
    layer = served.model.layers[0].mlp.gate_up_proj
    # 4-bit codes kept packed for decode: torch's int4 planes, or the integer dot kernel's
    # codes where the plan runs them there (AVX2)
    kept = "cpu_intdot" if plan.int4_kernel == "intdot" else "cpu_planes"
    assert (getattr(layer, kept, None) is not None) == plan.gguf_packed
    dense_bf16 = _model(dtype="bfloat16")
    if plan.gguf_packed:  # a decode step reads the planes, not the dense copy beside them
        assert ModelCost.of(served, 0).weight_bytes < ModelCost.of(dense_bf16, 0).weight_bytes
    for rows in (4, 40):  # decode-sized (the int4 kernel) and prefill-sized (dense) products
        ref = _logits(exact, rows)
        bound = rel_err(_logits(dense_bf16, rows), ref)  # ~0.009 measured
        assert rel_err(_logits(served, rows), ref) < 1.5 * bound, rows
