"""The GPU tuners as `skyline tune` calls them, in Triton's interpreter on tiny shapes (smoke):
what they return is keyed as the kernels' dispatchers look it up, so a kept table is used."""

from __future__ import annotations

import torch

from skyline.bench import tuners
from skyline.bench.tuners import tune_device
from skyline.config import ModelArch
from skyline.ops import attention as attn
from skyline.ops.attention_config import shape_key
from skyline.ops.gemv import config_key
from skyline.tune import attention, gemv
from skyline.tune.workload import model_linears

ARCH = ModelArch(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def test_gemv_tuner_keys(capsys):
    dev = tune_device("test", smoke=True)
    out = gemv.tune_model(ARCH, [1, 32], 3600, dev, torch.bfloat16, log=lambda s: None)
    # 32 rows are not the GEMV's (cuBLAS takes them): one key per shape, at one row; a shape
    # is stored only where a candidate beat the default (timed, so possibly none here)
    assert set(out.get(gemv.KERNEL, {})) <= {config_key(1, n, k) for n, k in model_linears(ARCH)}
    n, k = model_linears(ARCH)[0]
    [r] = gemv.tune_shape(n, k, [1], tuners.device_bandwidth(dev), dev, torch.bfloat16)
    assert r["key"] == config_key(1, n, k) and r["config"], capsys.readouterr().out


def test_attention_tuner_keys():
    dev = tune_device("test", smoke=True)
    # a budget no busy machine spends: the prefill is tuned only while half of it is left
    out = attention.tune_model(ARCH, "auto", 16, [1, 3], [40], 3600, dev, prefill_len=32,
                               log=lambda s: None)
    key = shape_key(4, 2, 16, 16, torch.float32, torch.float32)  # the interpreter's fp32
    assert set(out[attn.DECODE_KERNEL]) == {f"{key}:b1", f"{key}:b2"}  # batch buckets
    assert set(out[attn.PREFILL_KERNEL]) == {f"{key}:q64"}
