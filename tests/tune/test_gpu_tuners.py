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
from skyline.ops.gemv_block import MXFP4, NVFP4, Q5_K, Q6_K
from skyline.tune import attention, gemv, gemv_block
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


def test_block_gemv_tuner_keys():
    arch = ModelArch(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256,
                     intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64)
    assert gemv_block.formats_of("nvfp4", "m") == [NVFP4]
    assert gemv_block.formats_of("mxfp4", "m") == [MXFP4]
    assert gemv_block.formats_of(None, "/x/model.Q4_K_M.gguf") == [Q6_K, Q5_K]
    assert gemv_block.formats_of("fp8", "m") == []
    # GGUF: one shape per projection, widths of whole super-blocks (down's 512 is, o's 256 is)
    assert gemv_block.shapes(arch, Q6_K) == [(256, 256), (128, 256), (512, 256), (256, 512)]
    assert gemv_block.shapes(arch, NVFP4) == gemv_block.shapes(arch, MXFP4) == model_linears(arch)
    for fmt in (NVFP4, Q6_K, Q5_K, MXFP4):  # every candidate is one the launcher accepts
        for m in (1, 3, 8):
            for cfg in gemv_block.candidates(fmt, m, 4096, 4096, 132):
                assert cfg["BLOCK_K"] % 256 == 0 and (cfg["A8"] or cfg["BLOCK_N"] >= 16)
    # in the interpreter: tiny shapes (a program is slow there)
    dev = tune_device("test", smoke=True)
    bw = tuners.device_bandwidth(dev)
    for fmt, k in ((NVFP4, 64), (Q5_K, 256), (MXFP4, 96)):
        [r] = gemv_block.tune_shape(fmt, 8, k, [2], bw, dev, torch.float16)
        assert r["key"] == f"8x{k}:m2" and r["default_us"] is not None
    tiny = ModelArch(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256,
                     intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                     head_dim=8)
    assert gemv_block.shapes(tiny, Q6_K) == [(8, 256)]
    out = gemv_block.tune_model(tiny, [Q6_K], [1], 3600, dev, torch.float16,
                                log=lambda s: None)
    # kept (under the name and key the launcher looks up) only where it beat the default
    assert set(out) <= {"gemv_q6_k"} and set(out.get("gemv_q6_k", {})) <= {"8x256:m1"}
