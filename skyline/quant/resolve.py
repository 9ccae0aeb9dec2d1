"""Which quantization a model loads with: the user's --quantization, or the checkpoint's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from skyline.config import QUANT_METHODS, ConfigError, QuantConfig

QUANT_METHOD_TAG = "skyline"  # quantization_config.quant_method of `skyline quantize` output
# Packed GGUF (dequantize per forward) is opt-in: on CPU its decode is slower than weights
# dequantized at load by more than the 1.5x we accept
# (bench/results/cpu/gguf-packed-int4-cpu-v2.json).
GGUF_PACKED_BY_DEFAULT = False


def saved_quant(path: str) -> dict[str, Any] | None:
    """The quantization_config of a `skyline quantize` checkpoint directory, else None."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        cfg = json.loads(config.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None  # read_model_arch reports a bad config.json
    if not isinstance(cfg, dict):
        return None
    if cfg.get("quant_method") != QUANT_METHOD_TAG:
        raise ConfigError(
            f"{path} is quantized with {cfg.get('quant_method')!r}, which skyline cannot load; "
            "use an unquantized checkpoint (skyline quantizes it with --quantization)"
        )
    return cfg


def resolve_quant_config(
    method: str | None, group_size: int, path: str, load_format: str
) -> QuantConfig:
    if method in (None, "auto"):
        method = None
    elif method not in QUANT_METHODS:
        QuantConfig(method=method)  # raises the one-sentence error
    saved = saved_quant(path) if load_format == "safetensors" else None
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
