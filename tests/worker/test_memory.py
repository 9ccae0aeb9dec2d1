"""Before loading, a model that will not fit in free memory stops with one sentence that says
what would fit (free memory patched; the weights' size from a model on the meta device)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.worker import memory

CPU = torch.device("cpu")


def _free(monkeypatch, gb: float) -> None:
    monkeypatch.setattr(memory, "free_memory", lambda device: int(gb * 1e9) +
                        memory.HEADROOM_BYTES)


def test_8b_in_float32_on_a_24gb_machine_names_what_fits(monkeypatch):
    cfg, _ = create_engine_config(EngineArgs(model="llama-3.1-8b", load_format="dummy",
                                             device="cpu", dtype="float32"))
    _free(monkeypatch, 20.3)
    with pytest.raises(ConfigError) as e:
        memory.check_memory(cfg, CPU)
    msg = str(e.value)
    assert msg.startswith("the weights need 32.2 GB in float32 but 20.3 GB is free"), msg
    assert "--dtype bfloat16 (16.1 GB)" in msg and "--quantization int4" in msg
    assert "\n" not in msg
    _free(monkeypatch, 10)  # bfloat16 no longer fits, int4 does
    with pytest.raises(ConfigError, match=r"; use --quantization int4 \(\d\.\d GB\)$"):
        memory.check_memory(cfg, CPU)
    _free(monkeypatch, 1)
    with pytest.raises(ConfigError, match="use a smaller model or a larger machine"):
        memory.check_memory(cfg, CPU)
    _free(monkeypatch, 40)
    memory.check_memory(cfg, CPU)


def test_weights_fit_but_the_kv_cache_asked_for_does_not(monkeypatch):
    cfg, _ = create_engine_config(EngineArgs(device="cpu", dtype="float32",
                                             kv_cache_memory="8GiB", max_model_len=8192))
    weights = memory.weight_bytes(cfg.model, CPU)
    assert 0.3e9 < weights < 0.8e9  # the default model's 135M parameters in float32
    _free(monkeypatch, 2)
    with pytest.raises(ConfigError, match=r"and the KV cache 8\.6 GB \(--kv-cache-memory\) but "
                                          r"2\.0 GB is free.*lower --kv-cache-memory to 1\.\dGiB"):
        memory.check_memory(cfg, CPU)


def test_free_memory_reads_this_machine():
    assert 0 < memory.free_memory(CPU) < 1 << 50


def test_cpu_serving_layouts_and_packed_gguf_count():
    # fp8 on a CPU is dequantized once at load, to the compute dtype: as large as float32
    cfg, _ = create_engine_config(EngineArgs(model="qwen3-8b", load_format="dummy",
                                             device="cpu", quantization="fp8"))
    assert memory.weight_bytes(cfg.model, CPU) > 30e9
    # GGUF blocks kept packed: at least the file
    cfg, _ = create_engine_config(EngineArgs(device="cpu", dtype="bfloat16",
                                             quantization="gguf"))
    assert memory.weight_bytes(cfg.model, CPU) >= 98e6


def test_a_format_not_built_on_meta_is_not_checked(monkeypatch):
    cfg, _ = create_engine_config(EngineArgs(model="llama-3.1-8b", load_format="dummy",
                                             device="cpu", quantization="nvfp4"))
    _free(monkeypatch, 1)
    memory.check_memory(cfg, CPU)  # its size is unknown before loading: no refusal


def test_experts_on_the_cpu_count_as_host_memory(monkeypatch):
    """--n-cpu-moe: on a GPU those experts' bytes leave the GPU's check for the host's."""
    cfg, _ = create_engine_config(EngineArgs(model="qwen3-30b-a3b", load_format="dummy",
                                             device="cpu", dtype="bfloat16", n_cpu_moe=24))
    assert cfg.parallel.n_cpu_moe == 24
    gpu = torch.device("cuda")
    whole = memory.weight_bytes(cfg.model, gpu)
    host = memory.host_expert_bytes(cfg.model, gpu, 24)
    assert memory.weight_bytes(cfg.model, gpu, 24) + host == whole
    assert 0.45 * whole < host < 0.5 * whole  # half of the 48 layers' experts
    assert memory.host_expert_bytes(cfg.model, CPU, 24) == 0  # a CPU engine: nothing moves

    def free(gpu_gb: float, host_gb: float) -> None:
        monkeypatch.setattr(memory, "free_memory", lambda d: memory.HEADROOM_BYTES + int(
            (gpu_gb if d.type == "cuda" else host_gb) * 1e9))

    free(40, 100)  # the whole model does not fit on the GPU; with half its experts out, it does
    memory.check_memory(cfg, gpu)
    all_on_gpu = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                       n_cpu_moe=0))
    with pytest.raises(ConfigError, match=r"^the weights need 61\.\d GB in bfloat16 but 40\.0 GB "
                                          r"is free on the GPU .*; use --n-cpu-moe 1\d "
                                          r"\(3\d\.\d GB on the GPU\)$"):
        memory.check_memory(all_on_gpu, gpu)
    free(40, 10)
    with pytest.raises(ConfigError, match=r"^the experts of --n-cpu-moe 24 need 2\d\.\d GB of "
                                          r"host memory but 10\.0 GB is free"):
        memory.check_memory(cfg, gpu)


def test_gpu_free_memory_counts_what_the_allocator_caches(monkeypatch):
    """Blocks this process's allocator keeps unused (an engine released without empty_cache)
    are free to the next engine, not in use."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    assert memory.free_memory(torch.device("cuda", 0)) == 68 * gib
