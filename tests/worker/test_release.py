"""An engine's device memory goes back when it is done with, without waiting for Python's
garbage collector: expert layers sit in no reference cycle (their parameters' loaders hold
them weakly), and a shut-down engine holds no model. (An MoE engine's experts left to the
collector were still held when the next engine of a benchmark sized its KV cache, which then
got 11 GiB instead of ~65 GiB on an H200.)"""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from skyline.configs import dummy_config_dir
from skyline.engine.frontend.llm import LLM
from skyline.model.layers.moe import FusedExperts


@pytest.fixture
def no_collector():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_expert_layer_is_freed_by_reference_counting(no_collector):
    layer = FusedExperts(4, 16, 8, bias=True)
    w13 = layer.w13
    w13.weight_loader(w13, torch.ones(8, 16), (1, "up"))  # the loader still loads
    assert torch.equal(w13.data[1, 8:], torch.ones(8, 16))
    refs = [weakref.ref(layer), weakref.ref(layer.w2), weakref.ref(layer.w13_bias)]
    del layer, w13
    assert all(r() is None for r in refs)


def test_shutdown_lets_go_of_the_weights(tmp_path, no_collector):
    cfg = json.loads((Path(dummy_config_dir("qwen3-30b-a3b")) / "config.json").read_text())
    cfg.update(vocab_size=256, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               num_experts=4, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", max_model_len=64)
    model = llm.engine.executor.runner.model
    refs = [weakref.ref(p) for p in model.parameters()]
    del model
    llm.generate([[1, 2, 3]])
    llm.shutdown()
    assert llm.engine.executor.runner.model is None
    assert all(r() is None for r in refs)
