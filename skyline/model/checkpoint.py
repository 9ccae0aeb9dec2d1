"""Writing a quantized model as a checkpoint that skyline loads directly (`skyline quantize`):
model.safetensors and config.json, whose `quantization_config` names the format, so loading
needs no --quantization; a mixed-precision checkpoint also lists every Linear's own format
under "layers"."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn

from skyline.config import ModelConfig, QuantConfig
from skyline.quant.checkpoint import quantized_state
from skyline.quant.method import linears
from skyline.quant.resolve import QUANT_METHOD_TAG

log = logging.getLogger(__name__)


def hf_config(path: str, load_format: str) -> dict[str, Any]:
    """The model's Hugging Face config: its config.json, or one made from a GGUF's metadata."""
    if load_format == "gguf":
        from skyline.model.gguf import read_gguf_hf_config

        return read_gguf_hf_config(path)
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))


def write_checkpoint(
    model: nn.Module, model_cfg: ModelConfig, qcfg: QuantConfig, out_dir: str,
    calibration: dict[str, Any],
) -> dict[str, Any]:
    """Write quantized `model` (quantized as `qcfg` from `model_cfg`'s weights) to `out_dir`:
    model.safetensors and config.json with the quantization_config (every Linear's own format
    under "layers" when they differ); the tokenizer is the caller's. Returns the
    quantization_config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(quantized_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    meta: dict[str, Any] = {"quant_method": QUANT_METHOD_TAG, "format": qcfg.method,
                            "group_size": qcfg.group_size}
    if qcfg.layers:
        meta["layers"] = {name: {"format": m.method, "group_size": m.group_size}
                          for name in linears(model) for m in [qcfg.for_layer(name)]}
    meta["calibration"] = calibration
    hf = hf_config(model_cfg.path, model_cfg.load_format)
    hf["quantization_config"] = meta
    hf["torch_dtype"] = model_cfg.dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
    log.info("wrote %s (%.1f MiB)", out, os.path.getsize(out / "model.safetensors") / 2**20)
    return meta
