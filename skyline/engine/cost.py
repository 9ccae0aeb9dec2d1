"""What a model costs without loading it: per token (the floors of offline runs already
stored), and the bytes a size budget gives its Linears (`skyline quantize --search`)."""

from __future__ import annotations

import torch

from skyline.config import ModelArch
from skyline.engine.create import resolve_model_path
from skyline.model.cost import ModelCost, meta_model_cost
from skyline.model.loader import read_model_arch
from skyline.model.registry import get_model_class
from skyline.quant.assignment import check_budget, parse_budget, parse_formats
from skyline.quant.method import linears
from skyline.quant.resolve import resolve_quant_config
from skyline.worker.kv_cache import FP8_DTYPE, bytes_per_block

__all__ = ["ModelCost", "format_budget", "model_cost"]


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


def format_budget(arch: ModelArch, formats: str, budget: str, group_size: int = 128) -> int:
    """The bytes `budget` gives the Linears of a model of `arch` (bits per weight such as
    "4.5", a size such as "70MiB", or a format's uniform size such as "int4-g32"), checked
    against `formats` (a comma-separated list of candidates, e.g. "int4,int8"): each Linear
    must fit in its smallest. Raises ConfigError otherwise; the shapes come from the meta
    device, so nothing is loaded."""
    fmts = parse_formats(formats, group_size)
    with torch.device("meta"):
        shapes = linears(get_model_class(arch.architecture)(arch))
    num_weights = sum(m.in_features * m.out_features for m in shapes.values())
    nbytes = parse_budget(budget, num_weights, shapes, group_size)
    check_budget(shapes, fmts, nbytes)
    return nbytes
