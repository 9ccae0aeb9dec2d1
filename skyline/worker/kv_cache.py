"""KV cache tensors: sizing from the memory budget and allocation, one tensor per layer."""

from __future__ import annotations

import logging

import torch

from skyline.config import CacheConfig, ConfigError, ModelArch

log = logging.getLogger(__name__)


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    # K and V for every layer.
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for(
    arch: ModelArch, cfg: CacheConfig, dtype: torch.dtype, device: torch.device,
    max_model_len: int, max_num_seqs: int, profile_peak_bytes: int = 0,
) -> int:
    """Blocks that fit: CPU from cfg.kv_cache_memory; CUDA from free memory after profiling."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = bytes_per_block(arch, cfg.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Memory other processes or non-torch allocations hold is outside our budget.
        other = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * cfg.gpu_memory_utilization) - other - profile_peak_bytes
    else:
        budget = cfg.kv_cache_memory
    # More blocks than every running sequence at full length can use only feed the prefix
    # cache; cap there, so small models do not allocate (and index) millions of blocks.
    blocks_per_seq = -(-max_model_len // cfg.block_size)
    n = min(budget // per_block, blocks_per_seq * max_num_seqs)
    if n < 1:
        where = "--gpu-memory-utilization" if device.type == "cuda" else "--kv-cache-memory"
        raise ConfigError(
            f"no memory is left for the KV cache ({budget / 2**20:.0f} MiB after the model); "
            f"raise {where} or use a smaller model or dtype"
        )
    return int(n)


def allocate_kv_cache(
    arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    # On CPU, untouched pages cost nothing until used (zeroing 2 GiB takes seconds); attention
    # only reads slots it wrote, and masks padding, so the contents need no initial value.
    alloc = torch.empty if device.type == "cpu" else torch.zeros
    return [alloc(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
