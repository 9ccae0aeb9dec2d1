"""Pre-quantized checkpoints of other tools, loaded onto skyline's own formats and kernels.

The tool is config.json's `quantization_config.quant_method` (ModelOpt's may instead be
hf_quant_config.json beside it): `checkpoint_quant` maps its settings onto a skyline format
(QuantConfig.method: fp8, int4, int8, nvfp4, mxfp4) and a `CheckpointLayout`; `translate`
then renames and repacks every tensor as it streams from the files into the names and layout
of skyline's own prequantized checkpoints (quant/checkpoint.py), once, so the model's loader and
the format's kernels are those of a `skyline quantize` checkpoint. What needs a whole layer
(sorting activation-ordered groups, one static input scale for q/k/v) is the format's
`finish_prequantized`. Linears the checkpoint stores unquantized stay unquantized; a layout
skyline does not take is refused with one sentence naming it.

| quant_method | module | skyline formats |
|---|---|---|
| gptq, awq | gptq.py | int4 (group 32/64/128/..., act order, sym/asym, v1/v2), int8 (GPTQ) |
| compressed-tensors | compressed.py | fp8 (tensor/channel/block scales), int4/8, nvfp4, mxfp4 |
| modelopt | modelopt.py | fp8 (static per tensor, or per channel), nvfp4 |
| mxfp4 | mxfp4.py | mxfp4 (gpt-oss's *_blocks / *_scales) |
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError, safe_open

from skyline.config import QUANT_METHODS, ConfigError, QuantConfig
from skyline.quant.external import compressed, gptq, modelopt, mxfp4

log = logging.getLogger(__name__)

TOOLS = {"gptq": gptq, "awq": gptq, "compressed-tensors": compressed, "modelopt": modelopt,
         "mxfp4": mxfp4}
FLOAT_DTYPES = ("F16", "BF16", "F32")
# Tensors some tools store for attention's KV cache; skyline calibrates its own fp8 KV scales.
KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")


def modelopt_config(path: str) -> dict[str, Any] | None:
    """The quantization settings of ModelOpt's hf_quant_config.json in `path`, if any."""
    file = Path(path) / "hf_quant_config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        return {"quant_method": "modelopt", **data["quantization"]}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"cannot read {file}; download it again") from None


def checkpoint_quant(q: dict[str, Any], path: str, method: str | None) -> QuantConfig:
    """The QuantConfig of a checkpoint quantized by another tool, whose settings are `q`;
    `method`: the user's --quantization (None: the checkpoint's)."""
    tool = q.get("quant_method")

    def refuse(what: str) -> NoReturn:
        raise ConfigError(f"{path} is quantized as {what}, which skyline does not load; use "
                          "another quantization of the model, or its unquantized checkpoint")

    module = TOOLS.get(tool)
    if module is None:
        raise ConfigError(
            f"{path} is quantized with {tool!r}, which skyline cannot load (it loads gptq, awq, "
            "compressed-tensors, modelopt and mxfp4 checkpoints); use an unquantized checkpoint "
            "(skyline quantizes it with --quantization)")
    fmt, group, layout = module.parse(q, refuse)
    assert fmt in QUANT_METHODS
    if method not in (None, fmt):
        raise ConfigError(f"{path} is already quantized ({tool}, loaded as {fmt}); drop "
                          f"--quantization or pass {fmt}")
    if group not in (16, 32, 64, 128, 256, 512, 1024):
        refuse(f"{tool} with groups of {group} columns")
    layout = dataclasses.replace(layout, full_precision=full_precision_modules(path))
    return QuantConfig(method=fmt, group_size=group, prequantized=True, layout=layout)


def full_precision_modules(path: str) -> frozenset[str]:
    """Checkpoint module names whose only tensors are a float `weight` (and `bias`): the
    Linears a quantized checkpoint keeps unquantized (with every norm and embedding, which are
    not Linears). Reads the files' headers only."""
    kinds: dict[str, set[str]] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.endswith(KV_SCALES):
                        continue
                    prefix, _, kind = name.rpartition(".")
                    float_weight = kind == "weight" and f.get_slice(name).get_dtype() in \
                        FLOAT_DTYPES
                    kinds.setdefault(prefix, set()).add("float" if float_weight else kind)
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"cannot read {file} ({e}); download it again") from None
    return frozenset(p for p, k in kinds.items() if "float" in k and k <= {"float", "bias"})


def translate(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig
              ) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in skyline's names and layout (those of another tool's
    checkpoint repacked, the rest as they are)."""
    if cfg.layout is None:
        return weights
    return TOOLS[cfg.layout.name].translate(_without_kv_scales(weights), cfg)


def _without_kv_scales(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    dropped = 0
    for name, t in weights:
        if name.endswith(KV_SCALES):
            dropped += 1
            continue
        yield name, t
    if dropped:
        log.info("ignored %d KV-cache scales of the checkpoint (--kv-cache-dtype fp8 calibrates "
                 "its own)", dropped)
