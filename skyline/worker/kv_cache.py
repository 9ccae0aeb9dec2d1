"""KV cache tensors: sizing from the memory budget and allocation, one tensor per layer;
for an fp8 cache, the per-layer K/V scales."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from skyline.config import CacheConfig, ConfigError, ModelArch
from skyline.model.partition import attention_layers
from skyline.ops.kv_quant import FP8_DTYPE, scale_from_amax

log = logging.getLogger(__name__)

# Random tokens in the forward that calibrates fp8 KV scales: a fixed count, so the scales do
# not depend on the token budget or the batch size. (Their amax is 0.7-0.8 of what 1024 tokens
# give on the default model, well inside SCALE_HEADROOM.)
CALIBRATION_TOKENS = 512


def kv_cache_dtype(cfg: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_DTYPE if cfg.kv_cache_dtype == "fp8_e4m3" else model_dtype


def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    # K and V for every layer.
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem


def num_blocks_for(
    arch: ModelArch, cfg: CacheConfig, dtype: torch.dtype, device: torch.device,
    max_model_len: int, max_num_seqs: int, profile_peak_bytes: int = 0,
    extra_bytes_per_block: int = 0,
) -> int:
    """Blocks that fit: CPU from cfg.kv_cache_memory; CUDA from free memory after profiling.
    `extra_bytes_per_block` is another cache's cost per block of the same tokens (a draft
    model's): the budget then holds that many blocks of both."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = bytes_per_block(arch, cfg.block_size, dtype) + extra_bytes_per_block
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # Everything in use now (the weights, other processes) is outside the KV budget.
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - profile_peak_bytes
        log.info("KV cache budget %.1f GiB = %.2f x %.1f GiB - %.1f GiB in use (weights, "
                 "buffers, other processes) - %.1f GiB peak of the largest step",
                 budget / 2**30, cfg.gpu_memory_utilization, total / 2**30,
                 (total - free) / 2**30, profile_peak_bytes / 2**30)
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
            f"raise {where}, use --kv-cache-dtype fp8, or use a smaller model or dtype"
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


@torch.inference_mode()
def calibrate_kv_scales(
    model: nn.Module, vocab_size: int, max_model_len: int, device: torch.device,
    token_ids: list[int] | None = None,
    forward: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) of an fp8 cache: the largest |k| and |v| each attention
    layer sees in one forward of CALIBRATION_TOKENS random tokens (fewer if max_model_len is
    smaller; `token_ids` instead, if given), mapped by `scale_from_amax` (with headroom;
    larger values saturate). `forward` runs the model (a pipeline stage's, through the
    stages: every stage draws the same tokens)."""
    layers = attention_layers(model)
    amax = [torch.zeros(2, device=device) for _ in layers]  # kept on the device: no sync

    def observe(i: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            k = args[1] if len(args) > 1 else kwargs["k"]
            v = args[2] if len(args) > 2 else kwargs["v"]
            seen = torch.stack([k.abs().amax(), v.abs().amax()]).float()
            torch.maximum(amax[i], seen, out=amax[i])
        return hook

    hooks = [layer.register_forward_pre_hook(observe(i), with_kwargs=True)
             for i, layer in enumerate(layers)]
    try:
        if token_ids is None:
            gen = torch.Generator().manual_seed(0)
            n = min(CALIBRATION_TOKENS, max_model_len)
            ids = torch.randint(0, vocab_size, (n,), generator=gen).to(device)
        else:
            ids = torch.tensor(token_ids, device=device)
        (forward or model)(ids, torch.arange(len(ids), device=device))
    finally:
        for h in hooks:
            h.remove()
    if device.type == "cuda":  # the activations' memory goes back before the cache is sized
        torch.cuda.empty_cache()
    scales = [(scale_from_amax(float(k)), scale_from_amax(float(v)))
              for k, v in torch.stack(amax).tolist()]
    log.info("fp8 KV cache: k_scale %.3g..%.3g, v_scale %.3g..%.3g over %d layers",
             min(s[0] for s in scales), max(s[0] for s in scales),
             min(s[1] for s in scales), max(s[1] for s in scales), len(scales))
    return scales
