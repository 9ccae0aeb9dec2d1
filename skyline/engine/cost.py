"""A model's cost per token without loading it (the floors of offline runs already stored)."""

from __future__ import annotations

import torch

from skyline.engine.create import resolve_model_path
from skyline.model.cost import ModelCost, meta_model_cost
from skyline.model.loader import read_model_arch
from skyline.quant.resolve import resolve_quant_config
from skyline.worker.kv_cache import FP8_DTYPE, bytes_per_block

__all__ = ["ModelCost", "model_cost"]


def model_cost(model: str, quantization: str | None = None,
               kv_cache_dtype: str = "auto") -> ModelCost:
    """The cost per token of `model` (a shipped config's name or a directory) with weights in
    `quantization` and a KV cache of `kv_cache_dtype` ("auto": bf16, or "fp8"), built on the
    meta device. A checkpoint's own expert format (gpt-oss's MXFP4) applies as when loading."""
    path = resolve_model_path(model, "dummy")
    arch, _ = read_model_arch(path, "dummy")
    kv_dtype = FP8_DTYPE if kv_cache_dtype in ("fp8", "fp8_e4m3") else torch.bfloat16
    quant = resolve_quant_config(quantization or "none", 128, path, "dummy")
    return meta_model_cost(arch, quant, bytes_per_block(arch, 1, kv_dtype))
