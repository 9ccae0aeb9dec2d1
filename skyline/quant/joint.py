"""The measuring side of the mixed-precision search (search.py): every Linear quantized once
per format, a stand-in method that runs a format's dequantized weight, and the joint KL of a
whole model against its unquantized self, re-running only the decoder layers from the first
one that changed.

The search model keeps float weights: a Linear in format f runs f's dequantized weight (and,
for fp8, fp8 activations), the same numbers the format's own method computes with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.progress import bar
from skyline.quant import make_linear_method
from skyline.quant.assignment import Format, linear_bytes
from skyline.quant.base import QuantLinearMethod
from skyline.quant.fp8 import quantize_rows_fp8
from skyline.quant.method import LinearLayer


@dataclass
class Choice:
    """One Linear in one format."""

    tensors: dict[str, torch.Tensor]  # the format's parameters (quantize_shards); {} for none
    nbytes: int
    energy: float = 0.0  # mean squared output error per calibration token


class SwapMethod:
    """A Linear's stand-in during the search: a fixed float32 weight [out, in] and, for fp8,
    activations rounded per token as Fp8LinearMethod's CPU path does."""

    def __init__(self, weight: torch.Tensor, act_fp8: bool = False) -> None:
        self.weight = weight
        self.act_fp8 = act_fp8

    def create_weights(self, layer: LinearLayer) -> None:  # the layer keeps its own parameters
        pass

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x W^T [..., out] (no bias)."""
        if self.act_fp8:
            xq, x_scale = quantize_rows_fp8(x)
            return F.linear(xq.float() * x_scale, self.weight).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype))

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if layer.bias is None else y + layer.bias


def linears(model: nn.Module) -> dict[str, LinearLayer]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearLayer)}


def quantize_choices(
    model: nn.Module, formats: list[Format], act_sq: dict[str, torch.Tensor] | None,
    energy_ids: list[int],
) -> dict[str, dict[Format, Choice]]:
    """Every Linear of the (unquantized) model quantized to every format, once, with the
    output error energy of each on the inputs the Linear sees when the model runs
    `energy_ids`."""
    inputs = linear_inputs(model, energy_ids)
    out: dict[str, dict[Format, Choice]] = {}
    lin = linears(model)
    for name, layer in bar(lin.items(), desc="quantizing to every format", unit=" Linears"):
        dtype = layer.weight.dtype
        x = inputs.pop(name)  # [T, in]
        ref = F.linear(x, layer.weight.float())  # [T, out]
        out[name] = {}
        for fmt in formats:
            tensors: dict[str, torch.Tensor] = {}
            if fmt.method != "none":
                method = make_linear_method(fmt.quant_config())
                assert isinstance(method, QuantLinearMethod)
                a = act_sq.get(name) if act_sq is not None else None
                tensors = method.quantize_shards(layer.weight.data, layer.shards, a)
            choice = out[name][fmt] = Choice(tensors, linear_bytes(layer, fmt, dtype))
            y = dequantized(layer, fmt, choice).matmul(x)
            choice.energy = (y - ref).square().sum().item() / max(1, x.shape[0])
    return out


@torch.no_grad()
def linear_inputs(model: nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """Linear name -> float32 [len(ids), in_features]: its input when the model runs `ids`."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach().float().clone()))
        for name, m in linears(model).items()]
    try:
        t = torch.tensor(ids)
        model(t, torch.arange(len(t)))
    finally:
        for h in hooks:
            h.remove()
    return inputs


def dequantized(layer: LinearLayer, fmt: Format, choice: Choice) -> SwapMethod:
    if fmt.method == "none":
        return SwapMethod(layer.weight.data.float())
    method = make_linear_method(fmt.quant_config())
    assert isinstance(method, QuantLinearMethod)
    return SwapMethod(method.dequantize(choice.tensors, layer.in_features), fmt.method == "fp8")


def swap_in(
    lin: dict[str, LinearLayer], choices: dict[str, dict[Format, Choice]],
    assignment: dict[str, Format],
) -> None:
    """Give each Linear its assigned format's SwapMethod."""
    for n, layer in lin.items():
        layer.linear_method = dequantized(layer, assignment[n], choices[n][assignment[n]])


def spread_windows(ids: list[int], num_tokens: int, window: int) -> list[list[int]]:
    """About `num_tokens` of `ids` as windows of `window` tokens spread evenly over `ids` (all
    of it when it is no longer), so that a sample sees more than the text's beginning."""
    count = max(1, num_tokens // window)
    if count * window >= len(ids):
        return [ids[s : s + window] for s in range(0, len(ids), window)]
    step = (len(ids) - window) / max(1, count - 1)
    return [ids[round(i * step) : round(i * step) + window] for i in range(count)]


class JointKL:
    """KL(reference || model) per token over fixed windows of token ids, for whatever methods
    the model's Linears hold now. Keeps every decoder layer's input for the last committed
    state, so a change in layer i re-runs layers i.. only."""

    def __init__(self, model: nn.Module, windows: list[list[int]]) -> None:
        inner = getattr(model, "model", None)
        if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
            raise ConfigError(f"the mixed-precision search supports Llama-style models, not "
                              f"{type(model).__name__}")
        self.model, self.inner = model, inner
        self.windows = [torch.tensor(w) for w in windows if len(w) > 1]
        self.num_tokens = sum(len(w) for w in self.windows)
        block = {id(m): i for i, b in enumerate(inner.layers) for m in b.modules()}
        self.block_of = {n: block.get(id(m), 0) for n, m in linears(model).items()}
        self.num_evals = 0
        self.states, ref = self._run(0, None)
        self.ref_logp = ref

    @torch.no_grad()
    def _run(
        self, start: int, base: list[list[tuple[torch.Tensor, torch.Tensor | None]]] | None
    ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor | None]]], list[torch.Tensor]]:
        """Run every window from decoder layer `start` (layer inputs before it from `base`);
        returns the inputs of layers start.. and the log-probs [len(window), vocab]."""
        states, logps = [], []
        layers = self.inner.layers
        for w, ids in enumerate(self.windows):
            positions = torch.arange(len(ids))
            if start == 0:
                x, residual = self.inner.embed_tokens(ids), None
            else:
                x, residual = _clone(base[w][start])  # type: ignore[index]
            kept = []
            for layer in layers[start:]:
                kept.append(_clone((x, residual)))
                x, residual = layer(positions, x, residual)
            x, _ = self.inner.norm(x, residual)
            states.append(kept)
            logps.append(self.model.compute_logits(x).float().log_softmax(-1))
        return states, logps

    def score(self, start: int = 0) -> tuple[float, Any]:
        """The joint KL with the model as it is now, valid if nothing before decoder layer
        `start` changed since the last commit; also a token to `commit` this state."""
        self.num_evals += 1
        states, logps = self._run(start, self.states)
        kl = sum(F.kl_div(lp, rp, log_target=True, reduction="sum").item()
                 for lp, rp in zip(logps, self.ref_logp, strict=True))
        return kl / self.num_tokens, (start, states)

    def commit(self, token: Any) -> None:
        start, states = token
        for w, kept in enumerate(states):
            self.states[w][start:] = kept


def _clone(state: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, Any]:
    # Block inputs are consumed by the fused residual norm on CUDA: keep private copies.
    x, residual = state
    return x.clone(), None if residual is None else residual.clone()


