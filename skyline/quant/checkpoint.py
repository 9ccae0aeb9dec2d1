"""Quantized checkpoints (`skyline quantize`): the Linears of a loaded, unquantized model
quantized in place, and the tensors of the quantized model as a checkpoint stores them
(model/checkpoint.py writes them)."""

from __future__ import annotations

import torch
from torch import nn

from skyline.config import SAVABLE_METHODS, ConfigError, QuantConfig
from skyline.progress import bar
from skyline.quant import make_linear_method
from skyline.quant.base import QuantLinearMethod
from skyline.quant.method import UnquantizedLinearMethod, linears


def quantize_loaded(
    model: nn.Module, cfg: QuantConfig, act_sq: dict[str, torch.Tensor] | None = None
) -> None:
    """Quantize the Linears of an unquantized, loaded model in place (online, as at load),
    each to its format in `cfg` (a Linear whose per-layer format is "none" stays as it is)."""
    check_savable(cfg)
    for name, module in bar(linears(model).items(), desc="quantizing", unit=" Linears"):
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
    if not cfg.layers and cfg.method not in SAVABLE_METHODS:
        raise ConfigError(f"--format must be one of {', '.join(SAVABLE_METHODS)}, "
                          f"got {cfg.method!r}")
    for method in {cfg.method, *(m for _, m, _ in cfg.layers)}:
        if method not in (*SAVABLE_METHODS, "none"):
            raise ConfigError(f"a per-layer format must be one of {', '.join(SAVABLE_METHODS)} "
                              f"or none, got {method!r}")


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named CPU tensors of a quantized model: each merged Linear split back into the
    checkpoint tensors it was loaded from (q/k/v, gate/up), per-tensor values as [1]. In a
    mixed-precision model, Linears left unquantized are written as plain weights."""
    hf_name = getattr(model, "_hf_name", lambda name, shard_id: name)
    layers = linears(model)
    if not any(isinstance(m.linear_method, QuantLinearMethod) for m in layers.values()):
        raise ConfigError("the model is not quantized; quantize the model first")
    out: dict[str, torch.Tensor] = {}
    owned: set[int] = set()
    for mod_name, module in layers.items():
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
