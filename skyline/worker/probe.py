"""What `--placement auto` measures of each device: the memory the engine may take on it and
the time one decoder layer of the model takes there for a decode step (parallel/placement.py
turns these into stages)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from skyline.config import CacheConfig, ModelConfig, QuantConfig
from skyline.model.loader import load_model, prepack_for_cpu
from skyline.model.weights import held_bytes
from skyline.parallel.placement import DeviceBudget
from skyline.worker.kv_cache import bytes_per_block, kv_cache_dtype
from skyline.worker.runner import DTYPES

PROBE_TOKENS = 4  # a small decode batch
PROBE_RUNS = 5


def available_cpu_bytes() -> int:
    """Memory the system can give without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_bytes(device: str, cache: CacheConfig) -> int:
    """Bytes for weights and the KV cache on `device`: a GPU's share by
    --gpu-memory-utilization less what is in use; the CPU's available memory (its KV cache
    is --kv-cache-memory, counted by the caller)."""
    if device == "cpu":
        return available_cpu_bytes()
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(total * cache.gpu_memory_utilization) - (total - free)


@torch.inference_mode()
def probe_layer(model: ModelConfig, device: str) -> tuple[float, int, int, int]:
    """(seconds per layer for a decode step, bytes of a layer, of the embedding, of the final
    norm and LM head) of `model` on `device`: one layer of it built with random weights."""
    quant = model.quant if model.quant.method != "gguf" else QuantConfig()
    one = dataclasses.replace(model, arch=dataclasses.replace(model.arch, num_layers=1),
                              load_format="dummy", quant=quant)
    m = load_model(one, device)
    dev = torch.device(device)
    if dev.type == "cpu":
        prepack_for_cpu(m, DTYPES[model.dtype])
    layer = m.model.layers[0]
    hidden = torch.randn(PROBE_TOKENS, model.arch.hidden_size, dtype=DTYPES[model.dtype],
                         device=dev)
    positions = torch.arange(PROBE_TOKENS, device=dev)
    times = []
    for _ in range(PROBE_RUNS + 1):  # the first run warms up
        t = time.perf_counter()
        layer(positions, hidden.clone(), None)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    head = [m.model.norm, m.lm_head]
    return (statistics.median(times[1:]), held_bytes(layer.modules()),
            held_bytes([m.model.embed_tokens]), held_bytes(head))


def device_budgets(model: ModelConfig, cache: CacheConfig, devices: list[str],
                   max_model_len: int) -> tuple[list[DeviceBudget], int, int, int]:
    """Each device's budget, and the bytes one layer needs (its weights and the KV cache of one
    sequence at full length), the embedding's and the head's."""
    kv = bytes_per_block(dataclasses.replace(model.arch, num_layers=1), max_model_len,
                         kv_cache_dtype(cache, DTYPES[model.dtype]))
    budgets = []
    layer_bytes = first = last = 0
    for d in devices:
        seconds, layer_bytes, first, last = probe_layer(model, d)
        free = free_bytes(d, cache) - (cache.kv_cache_memory if d == "cpu" else 0)
        budgets.append(DeviceBudget(d, free, seconds))
    return budgets, layer_bytes + kv, first, last
