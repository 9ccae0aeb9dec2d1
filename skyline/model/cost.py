"""What a model costs per token, from its layers as they serve: the arithmetic and bytes the
floors of bench/floor.py are made of."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from skyline.config import ModelArch, QuantConfig
from skyline.model.layers.embedding import LMHead
from skyline.model.layers.linear import Linear
from skyline.model.partition import attention_layers
from skyline.model.registry import get_model_class
from skyline.model.weights import held_bytes
from skyline.quant import attach_quant_methods, finish_loading


@dataclass(frozen=True)
class ModelCost:
    """What a model costs per token, from its layers."""

    linear_params: int  # weight elements of the Linear layers every token runs through
    head_params: int  # of the LM head, run by sampling tokens only
    weight_bytes: int  # every weight a decode step reads (as the layers store them)
    kv_bytes_per_token: int  # K and V of one token, every layer, as the cache stores them
    attn_flops_per_pair: int  # one query against one key, every layer: QK^T and PV

    @classmethod
    def of(cls, model: nn.Module, kv_bytes_per_token: int) -> ModelCost:
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        heads = [m for m in model.modules() if isinstance(m, LMHead)]
        head_bytes = sum(  # an fp8 head is read instead of the dense one
            sum(t.numel() * t.element_size() for t in (m.fp8_weight, m.fp8_scale))
            if m.fp8_weight is not None else m.weight.numel() * m.weight.element_size()
            for m in heads)
        return cls(
            linear_params=sum(m.in_features * m.out_features for m in linears),
            head_params=sum(m.weight.numel() for m in heads),
            weight_bytes=held_bytes(linears) + head_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            # the heads of the layers this model (this rank's part) runs
            attn_flops_per_pair=4 * sum(a.num_heads * a.head_dim
                                        for a in attention_layers(model)),
        )


def meta_model_cost(arch: ModelArch, quant: QuantConfig, kv_bytes_per_token: int) -> ModelCost:
    """The cost of a model of `arch` with weights in `quant`, built on the meta device: no
    memory, no weights, the layouts the engine serves with (online quantization included)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            m = get_model_class(arch.architecture)(arch)
            attach_quant_methods(m, quant)
        with torch.no_grad():
            finish_loading(m)
    finally:
        torch.set_default_dtype(prev)
    return ModelCost.of(m, kv_bytes_per_token)
