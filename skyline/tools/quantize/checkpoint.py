"""`skyline quantize`: quantize a model's Linear weights (optionally calibrated on text) and
write a safetensors checkpoint that skyline loads directly (config.json names the format
under `quantization_config`, so loading needs no --quantization). A mixed-precision
checkpoint (report.py, `--search`) also lists every Linear's own format under "layers"."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from skyline.config import ConfigError, ModelConfig, QuantConfig
from skyline.model.layers.linear import Linear
from skyline.quant import make_linear_method
from skyline.quant.base import QuantLinearMethod
from skyline.quant.method import UnquantizedLinearMethod
from skyline.quant.resolve import QUANT_METHOD_TAG

log = logging.getLogger(__name__)
SAVABLE = ("fp8", "int8", "int4", "mxfp4", "nvfp4")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja", "chat_template.json")


def quantize_loaded(
    model: nn.Module, cfg: QuantConfig, act_sq: dict[str, torch.Tensor] | None = None
) -> None:
    """Quantize the Linears of an unquantized, loaded model in place (online, as at load),
    each to its format in `cfg` (a Linear whose per-layer format is "none" stays as it is)."""
    check_savable(cfg)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            method = make_linear_method(cfg.for_layer(name))
            if method is None:
                continue
            assert isinstance(method, QuantLinearMethod)
            if act_sq is not None and name in act_sq:
                module.act_sq = act_sq[name]
            module.linear_method = method
            method.process_weights_after_loading(module)
            module.__dict__.pop("act_sq", None)


def check_savable(cfg: QuantConfig) -> None:
    """Raise unless every format of `cfg` can be written (per-layer "none" is allowed)."""
    if not cfg.layers and cfg.method not in SAVABLE:
        raise ConfigError(f"--format must be one of {', '.join(SAVABLE)}, got {cfg.method!r}")
    for method in {cfg.method, *(m for _, m, _ in cfg.layers)}:
        if method not in (*SAVABLE, "none"):
            raise ConfigError(f"a per-layer format must be one of {', '.join(SAVABLE)} or none, "
                              f"got {method!r}")


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of a quantized model: each merged Linear split back into the
    checkpoint tensors it was loaded from (q/k/v, gate/up), per-tensor values as [1]. In a
    mixed-precision model, Linears left unquantized are written as plain weights."""
    hf_name = getattr(model, "_hf_name", lambda name, shard_id: name)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    if not any(isinstance(m.linear_method, QuantLinearMethod) for _, m in linears):
        raise ConfigError("the model is not quantized; quantize the model first")
    out: dict[str, torch.Tensor] = {}
    owned: set[int] = set()
    for mod_name, module in linears:
        method = module.linear_method
        if isinstance(method, QuantLinearMethod):
            tensors, per_tensor = dict(method.tensors(module)), method.per_tensor
        elif isinstance(method, UnquantizedLinearMethod):
            tensors, per_tensor = {"weight": module.weight}, ()
        else:
            raise ConfigError(f"{mod_name} uses {type(method).__name__}, which cannot be saved")
        if module.bias is not None:
            tensors["bias"] = module.bias
        owned.update(id(t) for t in tensors.values())
        for shard_id, (offset, size) in module.shards.items():
            prefix = hf_name(f"{mod_name}.weight", shard_id).removesuffix(".weight")
            for name, t in tensors.items():
                rows = 1 if name in per_tensor else size
                out[f"{prefix}.{name}"] = t.detach().narrow(0, offset, rows).cpu().contiguous()
    for name, param in model.named_parameters():
        if id(param) not in owned:
            out[name] = param.detach().cpu().contiguous()
    return out


def _hf_config(path: str, load_format: str) -> dict[str, Any]:
    if load_format == "gguf":
        from skyline.model.gguf import read_gguf_hf_config

        return read_gguf_hf_config(path)
    return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))


def _write_tokenizer(path: str, load_format: str, out: Path) -> None:
    if load_format == "gguf":
        from skyline.engine.frontend.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(path)
        tok.backend.save(str(out / "tokenizer.json"))
        cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
               "pad_token": tok.pad_token, "chat_template": tok.chat_template}
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        return
    for name in _TOKENIZER_FILES:
        src = Path(path) / name
        if src.is_file():
            shutil.copy(src, out / name)


def quantize_checkpoint(
    model_cfg: ModelConfig, fmt: str, out_dir: str, group_size: int = 128,
    calib_text: str | None = None, calib_ids: list[int] | None = None,
    calib_tokens: int = 4096,
) -> dict[str, Any]:
    """Load `model_cfg` (unquantized), calibrate on `calib_ids` or the tokenized `calib_text`
    (the built-in text when both are None and the model has a tokenizer), quantize to `fmt`,
    write `out_dir`. Returns the quantization_config written."""
    from skyline.model.loader import load_model
    from skyline.quant.calibrate import builtin_text, collect_act_sq

    qcfg = QuantConfig(method=fmt if fmt in SAVABLE else "none", group_size=group_size)
    if fmt not in SAVABLE:
        raise ConfigError(f"--format must be one of {', '.join(SAVABLE)}, got {fmt!r}")
    if model_cfg.quant.method != "none":
        raise ConfigError("skyline quantize needs an unquantized model; pass the original one")
    model = load_model(model_cfg, "cpu")
    source = "token ids"
    if calib_ids is None:
        from skyline.engine.frontend.llm import load_tokenizer

        tok = load_tokenizer(model_cfg)
        if tok is None:
            log.warning("%s has no tokenizer; quantizing without calibration", model_cfg.path)
        else:
            source = "built-in text" if calib_text is None else "given text"
            calib_ids = tok.encode(calib_text if calib_text is not None else builtin_text())
    act_sq = None
    if calib_ids:
        calib_ids = calib_ids[:calib_tokens]
        act_sq = collect_act_sq(model, calib_ids)
    quantize_loaded(model, qcfg, act_sq)
    calibration = {"source": source if act_sq else "none", "tokens": len(calib_ids or [])}
    return write_checkpoint(model, model_cfg, qcfg, out_dir, calibration)


def write_checkpoint(
    model: nn.Module, model_cfg: ModelConfig, qcfg: QuantConfig, out_dir: str,
    calibration: dict[str, Any],
) -> dict[str, Any]:
    """Write quantized `model` (quantized as `qcfg` from `model_cfg`'s weights) to `out_dir`:
    model.safetensors, config.json with the quantization_config (every Linear's own format
    under "layers" when they differ), the tokenizer. Returns the quantization_config."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(quantized_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    meta: dict[str, Any] = {"quant_method": QUANT_METHOD_TAG, "format": qcfg.method,
                            "group_size": qcfg.group_size}
    if qcfg.layers:
        meta["layers"] = {name: {"format": m.method, "group_size": m.group_size}
                          for name, mod in model.named_modules() if isinstance(mod, Linear)
                          for m in [qcfg.for_layer(name)]}
    meta["calibration"] = calibration
    hf = _hf_config(model_cfg.path, model_cfg.load_format)
    hf["quantization_config"] = meta
    hf["torch_dtype"] = model_cfg.dtype
    (out / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")
    _write_tokenizer(model_cfg.path, model_cfg.load_format, out)
    log.info("wrote %s (%.1f MiB)", out, os.path.getsize(out / "model.safetensors") / 2**20)
    return meta
