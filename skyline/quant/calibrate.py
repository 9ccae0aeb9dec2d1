"""Calibration: run text through a full-precision model and record, for every Linear, the
mean squared input activation per input channel (what the int4 clip search weighs errors by)."""

from __future__ import annotations

import torch
from torch import nn

from skyline.progress import bar
from skyline.quant.method import LinearLayer


@torch.no_grad()
def collect_act_sq(
    model: nn.Module, token_ids: list[int], window: int = 512
) -> dict[str, torch.Tensor]:
    """Linear module name -> float32 [in_features] mean of x^2 over all calibration tokens.

    The text runs as independent windows of `window` tokens (no forward context: each call is
    one causal sequence), so long texts need no KV cache.
    """
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, LinearLayer):
            def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()  # [tokens, in_features]
                sums[name] = sums.get(name, 0) + x.square().sum(0)
                counts[name] = counts.get(name, 0) + x.shape[0]

            hooks.append(module.register_forward_pre_hook(hook))
    device = next(model.parameters()).device
    try:
        starts = range(0, len(token_ids), window)
        for start in bar(starts, desc="calibrating", unit=" windows"):
            ids = torch.tensor(token_ids[start : start + window], device=device)
            model(ids, torch.arange(len(ids), device=device))
    finally:
        for h in hooks:
            h.remove()
    return {name: (s / counts[name]).cpu() for name, s in sums.items()}
