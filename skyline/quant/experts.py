"""Weight formats of MoE experts: the expert layer (model/layers/moe.py's FusedExperts) owns an
`ExpertMethod`, as a Linear owns its LinearMethod: the method creates the stacked weights and
runs the experts through ops/moe.py; model files never change.

Formats: "none" (the model dtype), "fp8" (weight-only e4m3 with a float32 scale per output
channel, quantized while loading; ops/moe.py's kernel also takes block scales) and "mxfp4"
(E2M1 codes with an E8M0 scale per 32, loaded as a gpt-oss checkpoint ships them, or quantized
while loading); a GGUF file's experts keep its blocks (quant/gguf_experts.py). The layer's
projections: w13 [E, 2I, H] (gate then up) and w2 [E, H, I], rows
being output features; their biases stay in the model dtype. This package names the layer
through the `ExpertLayer` protocol, never the class.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from skyline.config import EXPERT_FORMATS, ConfigError
from skyline.ops.fp8_quant import quantize_rows_fp8
from skyline.ops.moe import ExpertWeights, fused_moe
from skyline.quant.fp4 import quantize_mxfp4

# The parts of each projection a checkpoint stores per expert, in row order.
PARTS = {"w13": ("gate", "up"), "w2": ("down",)}


@runtime_checkable
class ExpertLayer(Protocol):
    """What a method sees of its expert layer: `num_experts` experts held here (of
    `placement.num_experts`), each a gated MLP hidden_size -> intermediate_size -> hidden_size;
    `expert_ids` the global ids of those held, in order."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    expert_ids: range
    expert_method: Any

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Any = None) -> None: ...


def set_expert_loader(param: nn.Parameter, layer: ExpertLayer, proj: str) -> None:
    """Give a stacked parameter of projection `proj` its loader and the (expert, part) shards
    the checkpoint must supply. The loader holds the layer weakly: a bound method would close
    the cycle layer -> parameter -> loader -> layer, and the experts' weights (most of an MoE
    model's bytes) would then outlive their engine until the garbage collector's next full
    pass, held while the next engine in the process sizes its KV cache."""
    method = weakref.WeakMethod(layer.weight_loader)

    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        bound = method()
        assert bound is not None, "the expert layer of this parameter was freed"
        bound(param, loaded, shard_id)

    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    param.shard_ids = tuple((e, part) for e in layer.expert_ids  # type: ignore[attr-defined]
                            for part in PARTS[proj])


def _shapes(layer: ExpertLayer) -> dict[str, tuple[int, int, int]]:
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    return {"w13": (e, 2 * i, h), "w2": (e, h, i)}


def _new(layer: ExpertLayer, name: str, shape: tuple[int, ...], proj: str,
         dtype: torch.dtype | None = None) -> None:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    setattr(layer, name, param)
    set_expert_loader(param, layer, proj)


def _bias(layer: ExpertLayer, proj: str) -> torch.Tensor | None:
    return getattr(layer, f"{proj}_bias", None)


class UnquantizedExpertMethod:
    """Stacked weights in the model dtype."""

    fmt = "none"

    def create_weights(self, layer: ExpertLayer) -> None:
        for proj, shape in _shapes(layer).items():
            _new(layer, proj, shape, proj)

    def weights(self, layer: ExpertLayer) -> tuple[ExpertWeights, ExpertWeights]:
        return tuple(ExpertWeights(getattr(layer, p), bias=_bias(layer, p))  # type: ignore
                     for p in PARTS)

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.weights(layer)
        return fused_moe(x, w13, w2, topk_weights, topk_ids, layer.activation,
                         layer.swiglu_limit, layer.expert_map)


class Fp8ExpertMethod(UnquantizedExpertMethod):
    """Weight-only fp8: e4m3 weights with a float32 scale per output channel of every expert,
    quantized from the full-precision weights once loading is done."""

    fmt = "fp8"

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:
        for proj in PARTS:
            w = getattr(layer, proj).data
            e, n, k = w.shape
            q, scale = quantize_rows_fp8(w.reshape(e * n, k))
            setattr(layer, proj, nn.Parameter(q.view(e, n, k), requires_grad=False))
            setattr(layer, f"{proj}_scale",
                    nn.Parameter(scale.view(e, n), requires_grad=False))

    def weights(self, layer: ExpertLayer) -> tuple[ExpertWeights, ExpertWeights]:
        if not hasattr(layer, "w13_scale"):  # dequantized for the CPU (prepack_cpu)
            return super().weights(layer)
        return tuple(ExpertWeights(getattr(layer, p), getattr(layer, f"{p}_scale"),  # type: ignore
                                   _bias(layer, p), "fp8") for p in PARTS)

    def prepack_cpu(self, layer: ExpertLayer, dtype: torch.dtype) -> bool:
        """For a CPU engine: the experts dequantized once to the engine's dtype (no CPU has
        fp8 units; the reference would dequantize every expert it runs at every call)."""
        for proj, w in zip(PARTS, self.weights(layer), strict=True):
            dense = torch.stack([w.expert(e, dtype) for e in range(w.num_experts)])
            setattr(layer, proj, nn.Parameter(dense, requires_grad=False))
            delattr(layer, f"{proj}_scale")
        return True


class Mxfp4ExpertMethod(UnquantizedExpertMethod):
    """MXFP4: codes [E, N, K / 2] (`<proj>_blocks`) and E8M0 scales [E, N, K / 32]
    (`<proj>_scales`), as gpt-oss checkpoints ship them (prequantized), or quantized from the
    full-precision weights once loading is done. On the CPU the experts a step runs are
    dequantized at each call (ops/moe.py's reference)."""

    fmt = "mxfp4"

    def __init__(self, prequantized: bool = False) -> None:
        self.prequantized = prequantized

    def create_weights(self, layer: ExpertLayer) -> None:
        for proj, (e, n, k) in _shapes(layer).items():
            if k % 32:
                raise ConfigError(f"MXFP4 experts need input sizes that are multiples of 32; "
                                  f"this model's are {k}; use --quantization fp8 or none")
            if not self.prequantized:
                _new(layer, proj, (e, n, k), proj)
                continue
            _new(layer, f"{proj}_blocks", (e, n, k // 2), proj, torch.uint8)
            _new(layer, f"{proj}_scales", (e, n, k // 32), proj, torch.uint8)

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:
        if self.prequantized:
            return
        for proj in PARTS:
            w = getattr(layer, proj).data
            e, n, k = w.shape
            codes, scales = quantize_mxfp4(w.reshape(e * n, k))
            delattr(layer, proj)
            setattr(layer, f"{proj}_blocks",
                    nn.Parameter(codes.view(e, n, k // 2), requires_grad=False))
            setattr(layer, f"{proj}_scales",
                    nn.Parameter(scales.view(e, n, k // 32), requires_grad=False))

    def weights(self, layer: ExpertLayer) -> tuple[ExpertWeights, ExpertWeights]:
        return tuple(ExpertWeights(getattr(layer, f"{p}_blocks"),  # type: ignore
                                   getattr(layer, f"{p}_scales"), _bias(layer, p), "mxfp4")
                     for p in PARTS)

    def fill_dummy(self, layer: ExpertLayer, gen: torch.Generator) -> None:
        """Random codes with scales of 2^-10: weights of magnitude ~1e-3, as dummy dense
        weights have."""
        for proj in PARTS:
            blocks = getattr(layer, f"{proj}_blocks")
            blocks.data.copy_(torch.randint(0, 256, blocks.shape, generator=gen,
                                            device=blocks.device, dtype=torch.int32))
            getattr(layer, f"{proj}_scales").data.fill_(127 - 10)


def make_expert_method(fmt: str, prequantized: bool = False) -> UnquantizedExpertMethod:
    """The method of expert format `fmt` (one of EXPERT_FORMATS, or "gguf": a GGUF file's
    blocks, quant/gguf_experts.py; other weight formats have no MoE kernel and are refused)."""
    if fmt == "none":
        return UnquantizedExpertMethod()
    if fmt == "fp8":
        if prequantized:
            raise ConfigError("fp8 expert weights load from a full-precision checkpoint only; "
                              "pass the unquantized model with --quantization fp8")
        return Fp8ExpertMethod()
    if fmt == "mxfp4":
        return Mxfp4ExpertMethod(prequantized)
    if fmt == "gguf":
        from skyline.quant.gguf_experts import GGUFExpertMethod

        return GGUFExpertMethod()
    raise ConfigError(f"mixture-of-experts weights can be {', '.join(EXPERT_FORMATS)}, not "
                      f"{fmt!r}; use --quantization fp8, mxfp4 or none with this model")
