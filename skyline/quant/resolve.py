"""Which quantization a model loads with: the user's --quantization, or the checkpoint's own
(written by `skyline quantize`, or by another tool: quant/external/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skyline.config import QUANT_METHODS, ConfigError, QuantConfig
from skyline.quant.external import checkpoint_quant, modelopt_config

QUANT_METHOD_TAG = "skyline"  # quantization_config.quant_method of `skyline quantize` output
# quantization_config.quant_method of checkpoints that ship their MoE experts in MXFP4 and the
# rest unquantized (gpt-oss)
EXPERTS_MXFP4_TAG = "mxfp4"
# Packed GGUF (dequantize per forward) is opt-in: on CPU its decode is slower than weights
# dequantized at load by more than the 1.5x we accept
# (bench/results/cpu/gguf-packed-int4-cpu-v2.json).
GGUF_PACKED_BY_DEFAULT = False


def quantization_config(path: str) -> dict[str, Any] | None:
    """The quantization settings of checkpoint directory `path`: config.json's
    quantization_config, or ModelOpt's hf_quant_config.json; None for an unquantized one."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        cfg = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None  # read_model_arch reports a bad config.json
    return cfg if isinstance(cfg, dict) else modelopt_config(path)


def _has_experts(path: str) -> bool:
    """Whether config.json in `path` declares MoE experts (gpt-oss, Mixtral, Qwen3-MoE)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(cfg, dict) and bool(cfg.get("num_local_experts") or cfg.get("num_experts"))


def resolve_quant_config(
    method: str | None, group_size: int, path: str, load_format: str
) -> QuantConfig:
    if method in (None, "auto"):
        method = None
    elif method not in QUANT_METHODS:
        QuantConfig(method=method)  # raises the one-sentence error
    ckpt = quantization_config(path) if load_format in ("safetensors", "dummy") else None
    if (ckpt is not None and ckpt.get("quant_method") == EXPERTS_MXFP4_TAG
            and _has_experts(path)):
        # gpt-oss: experts as shipped; the other Linears in --quantization's format
        if method == "gguf":
            raise ConfigError("--quantization gguf keeps a GGUF file's blocks packed, so it "
                              "needs a .gguf model")
        return QuantConfig(method=method or "none", group_size=group_size, experts="mxfp4",
                           experts_prequantized=True)
    saved = ckpt if load_format == "safetensors" else None
    if saved is not None and saved.get("quant_method") != QUANT_METHOD_TAG:
        return checkpoint_quant(saved, path, method)  # another tool's checkpoint
    if saved is not None:
        fmt = saved.get("format")
        layers = _saved_layers(saved.get("layers"), path)
        if fmt not in QUANT_METHODS or fmt == "gguf" or (fmt == "none" and not layers):
            raise ConfigError(f"{path}/config.json names an unknown quantization format {fmt!r}")
        if method not in (None, fmt):
            what = "with per-layer formats" if layers else f"as {fmt}"
            raise ConfigError(
                f"{path} is already quantized {what}; drop --quantization or pass {fmt}"
            )
        return QuantConfig(method=fmt, group_size=int(saved.get("group_size", 128)),
                           prequantized=True, layers=layers)
    if method is None:
        method = "gguf" if load_format == "gguf" and GGUF_PACKED_BY_DEFAULT else "none"
    if method == "gguf" and load_format != "gguf":
        raise ConfigError(
            "--quantization gguf keeps a GGUF file's blocks packed, so it needs a .gguf model"
        )
    return QuantConfig(method=method, group_size=group_size)


def _saved_layers(layers: Any, path: str) -> tuple[tuple[str, str, int], ...]:
    """quantization_config.layers ({linear name: {"format", "group_size"}}) as QuantConfig
    per-layer triples."""
    if layers is None:
        return ()
    bad = ConfigError(f"{path}/config.json has malformed per-layer formats; write it again "
                      "with skyline quantize")
    if not isinstance(layers, dict):
        raise bad
    out = []
    for name, spec in layers.items():
        if not isinstance(spec, dict) or spec.get("format") not in QUANT_METHODS:
            raise bad
        if spec["format"] == "gguf":
            raise bad
        try:
            out.append((name, spec["format"], int(spec.get("group_size", 128))))
        except (TypeError, ValueError):
            raise bad from None
    return tuple(out)
