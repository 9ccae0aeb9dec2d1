"""Quantization: one LinearMethod per weight format, given to every Linear by the loader.

Formats: fp8 (W8A8), int8 / int4 (weight-only, group-wise), mxfp4 / nvfp4 (weight-only FP4
blocks), gguf (a GGUF file's blocks kept packed). Embeddings and the LM head keep the model
dtype. `skyline quantize` writes a checkpoint that loads without requantizing. Formats may
differ per Linear (QuantConfig.layers); search.py chooses them for a size budget by the
end-to-end KL divergence they cause. The Linear itself is model/'s: this package knows it only
through the protocol in method.py.
"""

from __future__ import annotations

from torch import nn

from skyline.config import ConfigError, QuantConfig
from skyline.quant.experts import ExpertLayer, make_expert_method
from skyline.quant.method import LinearMethod, linears


def make_linear_method(cfg: QuantConfig) -> LinearMethod | None:
    """A fresh method for one Linear (methods may keep per-layer state); None for "none"."""
    if cfg.method == "none":
        return None
    if cfg.method == "fp8":
        from skyline.quant.fp8 import Fp8LinearMethod

        return Fp8LinearMethod(cfg)
    if cfg.method in ("int8", "int4"):
        from skyline.quant.intq import IntLinearMethod

        return IntLinearMethod(cfg, bits=int(cfg.method[3:]))
    if cfg.method == "mxfp4":
        from skyline.quant.fp4 import Mxfp4LinearMethod

        return Mxfp4LinearMethod(cfg)
    if cfg.method == "nvfp4":
        from skyline.quant.fp4 import Nvfp4LinearMethod

        return Nvfp4LinearMethod(cfg)
    from skyline.quant.gguf import GGUFLinearMethod

    return GGUFLinearMethod()


def attach_quant_methods(model: nn.Module, cfg: QuantConfig) -> None:
    """Give every Linear and MoE expert layer of `model` the method of its format in `cfg`
    (before loading weights); those whose format is "none", and Linears that another tool's
    checkpoint stores unquantized, keep the unquantized method."""
    for name, module in model.named_modules():
        if isinstance(module, ExpertLayer):
            fmt, prequantized = cfg.expert_format(name)
            if fmt != "none":
                module.set_expert_method(make_expert_method(fmt, prequantized))
    if cfg.method == "none" and not cfg.layers:
        return
    for name, module in linears(model).items():
        if cfg.layout is not None and _stored_unquantized(model, name, module, cfg):
            continue
        method = make_linear_method(cfg.for_layer(name))
        if method is not None:
            module.set_linear_method(method)


def _stored_unquantized(model: nn.Module, name: str, module: nn.Module, cfg: QuantConfig) -> bool:
    """Whether the checkpoint stores Linear `name` unquantized: all of its projections, or
    none (they run as one matmul)."""
    assert cfg.layout is not None
    hf_name = getattr(model, "_hf_name", lambda name, shard_id: name)
    parts = {hf_name(f"{name}.weight", s).removesuffix(".weight"): s for s in module.shards}
    full = [p in cfg.layout.full_precision for p in parts]
    if any(full) and not all(full):
        raise ConfigError(f"the checkpoint quantizes some of {', '.join(parts)} but not all; "
                          "skyline runs them as one matmul, so they need one format")
    return all(full)


def finish_loading(model: nn.Module) -> None:
    """Let every Linear's and expert layer's method convert what was loaded (online
    quantization, packing)."""
    for module in model.modules():
        method = getattr(module, "linear_method", None) or getattr(module, "expert_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is not None:
            process(module)
