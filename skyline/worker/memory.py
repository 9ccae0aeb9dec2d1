"""Will the model fit? Before loading, the weights' bytes as the engine will hold them (from a
model built on the meta device: the architecture, the dtype and the quantization chosen) and,
on a CPU, the KV cache asked for, against the target device's free memory: a model that does
not fit stops with one sentence saying what would, instead of being killed by the kernel's
out-of-memory killer half-way through loading."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from skyline.config import ConfigError, EngineConfig, ModelConfig
from skyline.model.cost import meta_model
from skyline.model.layers.moe import FusedExperts
from skyline.model.loader import DTYPES, prepack_for_cpu
from skyline.model.weights import held_bytes
from skyline.quant.resolve import resolve_quant_config
from skyline.worker.kv_cache import bytes_per_block, kv_cache_dtype, num_blocks_for

log = logging.getLogger(__name__)

# Memory the process needs beyond weights and KV cache (the runtime, activations, buffers):
# the margin a check leaves so that a model that "just fits" is not killed while it runs.
HEADROOM_BYTES = 1 << 30


def free_memory(device: torch.device) -> int:
    """Bytes free for this process on `device`: a GPU's free memory, with what this process's
    caching allocator holds unused (an earlier engine's, until empty_cache hands it back); on
    the CPU the memory the kernel can give without swapping (MemAvailable), within this
    cgroup's limit if it has one."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


def weight_bytes(cfg: ModelConfig, device: torch.device, host_moe_layers: int = 0
                 ) -> int | None:
    """Bytes of the weights of `cfg` as the engine holds them on `device` (built on the meta
    device, in the CPU's serving layouts there); None where a format cannot be built on meta.
    On a GPU, the experts of the first `host_moe_layers` layers (--n-cpu-moe) are left out:
    they live in host memory (`host_expert_bytes`)."""
    both = _weight_bytes(cfg, device, host_moe_layers)
    return None if both is None else both[0]


def host_expert_bytes(cfg: ModelConfig, device: torch.device, host_moe_layers: int) -> int:
    """Bytes of the experts a GPU engine keeps in host memory (--n-cpu-moe); 0 on a CPU."""
    both = _weight_bytes(cfg, device, host_moe_layers)
    return 0 if both is None else both[1]


def _weight_bytes(cfg: ModelConfig, device: torch.device, host_moe_layers: int
                  ) -> tuple[int, int] | None:
    try:
        model = meta_model(cfg.arch, cfg.quant, DTYPES[cfg.dtype])
        if device.type == "cpu":
            prepack_for_cpu(model, DTYPES[cfg.dtype])  # e.g. fp8 dequantized once
    except (RuntimeError, NotImplementedError) as e:  # a format whose setup reads values
        log.info("the weights' size of %s is not known before loading (%s); not checking "
                 "free memory", cfg.quant.method, e)
        return None
    held = held_bytes(model.modules())
    if cfg.quant.method == "gguf":  # blocks kept packed: they arrive with the file
        held = max(held, os.path.getsize(cfg.path))
    host = 0
    if device.type != "cpu" and host_moe_layers:
        host = held_bytes(m for layer in list(model.model.layers)[:host_moe_layers]
                          for m in layer.modules() if isinstance(m, FusedExperts))
    return held - host, host


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def check_memory(config: EngineConfig, device: torch.device) -> None:
    """Raise ConfigError, naming what fits, when the weights (and on a CPU the KV cache) will
    not fit in `device`'s free memory. On a GPU the KV cache takes what the weights leave."""
    m = config.model
    n_cpu_moe = config.parallel.n_cpu_moe
    both = _weight_bytes(m, device, n_cpu_moe)
    if both is None:
        return
    weights, host = both
    cpu = torch.device("cpu")
    if host and host > free_memory(cpu) - HEADROOM_BYTES:
        raise ConfigError(
            f"the experts of --n-cpu-moe {n_cpu_moe} need {_gb(host)} of host memory but "
            f"{_gb(free_memory(cpu) - HEADROOM_BYTES)} is free (keeping {_gb(HEADROOM_BYTES)} "
            "spare); lower --n-cpu-moe or use a quantized model")
    kv = 0
    if device.type == "cpu":
        sc = config.scheduler
        kv_dtype = kv_cache_dtype(config.cache, DTYPES[m.dtype])
        blocks = num_blocks_for(m.arch, config.cache, kv_dtype, device, sc.max_model_len,
                                sc.max_num_seqs)
        kv = blocks * bytes_per_block(m.arch, config.cache.block_size, kv_dtype)
    free = free_memory(device) - HEADROOM_BYTES
    if weights + kv <= free:
        return
    where = "the GPU" if device.type == "cuda" else "this machine"
    quant = "" if m.quant.method == "none" else f" with --quantization {m.quant.method}"
    need = f"the weights need {_gb(weights)} in {m.dtype}{quant}"
    if weights <= free:
        raise ConfigError(
            f"{need} and the KV cache {_gb(kv)} (--kv-cache-memory) but {_gb(free)} is free on "
            f"{where} (keeping {_gb(HEADROOM_BYTES)} spare); lower --kv-cache-memory to "
            f"{max(free - weights, 0) / 2**30:.1f}GiB or less, or lower --max-model-len")
    options = []
    for flags, dtype, method in (("--dtype bfloat16", "bfloat16", m.quant.method),
                                 ("--quantization int4", None, "int4")):
        if (dtype or m.dtype) == m.dtype and method == m.quant.method:
            continue
        quant_cfg = m.quant if method == m.quant.method else \
            resolve_quant_config(method, m.quant.group_size, m.path, m.load_format)
        alt = dataclasses.replace(m, dtype=dtype or ("bfloat16" if device.type == "cpu"
                                                     else m.dtype), quant=quant_cfg)
        try:
            size = weight_bytes(alt, device, n_cpu_moe)
        except ConfigError:  # a format this model cannot take (int4 experts): no hint
            continue
        if size is not None and size + kv <= free:
            options.append(f"{flags} ({_gb(size)})")
    layers = m.arch.num_layers
    if device.type == "cuda" and m.arch.num_experts and n_cpu_moe < layers:
        # experts in host memory: the fewest first layers' that leave the rest room
        every = _weight_bytes(m, device, layers)
        per_layer = every[1] / layers if every is not None else 0
        n = min(layers, n_cpu_moe + int(-(-(weights + kv - free) // max(per_layer, 1))))
        size = weight_bytes(m, device, n) if per_layer else None
        if size is not None and size + kv <= free:
            options.append(f"--n-cpu-moe {n} ({_gb(size)} on the GPU)")
    hint = f"use {' or '.join(options)}" if options else "use a smaller model or a larger machine"
    raise ConfigError(f"{need} but {_gb(free)} is free on {where} (keeping "
                      f"{_gb(HEADROOM_BYTES)} spare); {hint}")
