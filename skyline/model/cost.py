"""What a model costs per token, from its layers as they serve: the arithmetic and bytes the
floors of skyline/bench/floor.py are made of. A mixture-of-experts layer costs a token its
router and the experts it is routed to (its active parameters); the experts a decode step reads
are those any of its tokens is routed to."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from skyline.config import ModelArch, QuantConfig
from skyline.model.layers.embedding import LMHead
from skyline.model.layers.linear import Linear
from skyline.model.layers.moe import FusedExperts, Router
from skyline.model.partition import attention_layers
from skyline.model.registry import get_model_class
from skyline.model.weights import held_bytes
from skyline.quant import attach_quant_methods, finish_loading


@dataclass(frozen=True)
class ModelCost:
    """What a model costs per token, from its layers."""

    linear_params: int  # weight elements of the Linears, routers and experts a token runs
    head_params: int  # of the LM head, run by sampling tokens only
    weight_bytes: int  # every weight a batch-1 decode step reads (as the layers store them)
    kv_bytes_per_token: int  # K and V of one token, every layer, as the cache stores them
    attn_flops_per_pair: int  # one query against one key, every layer: QK^T and PV
    # MoE: the bytes of every expert of every layer, and the share of them one token runs
    # (top-k / experts); weight_bytes counts that share of expert_bytes
    expert_bytes: int = 0
    expert_fraction: float = 0.0
    # of expert_bytes, the experts held in host memory and run by the CPU (--n-cpu-moe)
    host_expert_bytes: int = 0

    def step_weight_bytes(self, rows: float) -> float:
        """Weight bytes a decode step of `rows` tokens reads: every dense weight, and each
        expert that at least one token is routed to, expected over uniform routing."""
        touched = 1 - (1 - self.expert_fraction) ** rows if self.expert_bytes else 0.0
        return self.weight_bytes + self.expert_bytes * (touched - self.expert_fraction)

    @classmethod
    def of(cls, model: nn.Module, kv_bytes_per_token: int) -> ModelCost:
        linears = [m for m in model.modules() if isinstance(m, (Linear, Router))]
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        heads = [m for m in model.modules() if isinstance(m, LMHead)]
        arch = model.arch
        head_bytes = sum(_head_bytes(m) for m in heads)
        fraction = arch.num_experts_per_tok / arch.num_experts if experts else 0.0
        expert_bytes = held_bytes(experts)
        expert_params = sum(3 * m.num_experts * m.hidden_size * m.intermediate_size
                            for m in experts)
        return cls(
            linear_params=sum(m.weight.numel() if isinstance(m, Router)
                              else m.in_features * m.out_features for m in linears)
            + round(expert_params * fraction),
            head_params=sum(m.weight.numel() for m in heads),
            weight_bytes=_decode_bytes(linears) + head_bytes + round(expert_bytes * fraction),
            kv_bytes_per_token=kv_bytes_per_token,
            # the heads of the layers this model (this rank's part) runs
            attn_flops_per_pair=4 * sum(a.num_heads * a.head_dim
                                        for a in attention_layers(model)),
            expert_bytes=expert_bytes,
            expert_fraction=fraction,
            host_expert_bytes=held_bytes(m for m in experts if m.weight_device == "cpu"),
        )


def _head_bytes(m: LMHead) -> int:
    """What the head's one-row product reads: a GGUF model's 8-bit copy on a CPU, else the
    CPU's oneDNN-packed copy, else an fp8 head's values and scales, else the dense weight."""
    if m.intdot_weight is not None and m.intdot_rows >= 1:
        return m.intdot_weight.nbytes()
    if m.packed_weight is not None:
        return m.packed_weight.numel() * m.packed_weight.element_size()
    if m.fp8_weight is not None:
        return sum(t.numel() * t.element_size() for t in (m.fp8_weight, m.fp8_scale))
    return m.weight.numel() * m.weight.element_size()


def _decode_bytes(layers: list[nn.Module]) -> int:
    """Bytes a decode step's products read: a layer whose format serves a row from a smaller
    layout than it holds (`decode_bytes`: a CPU GGUF layer's int4 planes beside its dense
    copy) counts that layout, any other all it holds."""
    total = 0
    for m in layers:
        method = getattr(m, "linear_method", None)
        read = getattr(method, "decode_bytes", None)
        n = read(m) if read is not None else None
        total += held_bytes([m]) if n is None else n
    return total


def meta_model(arch: ModelArch, quant: QuantConfig, dtype: torch.dtype = torch.bfloat16
               ) -> nn.Module:
    """A model of `arch` with weights in `quant` and `dtype`, built on the meta device: no
    memory, no weights, the layouts the engine serves with (online quantization included)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            m = get_model_class(arch.architecture)(arch)
            attach_quant_methods(m, quant)
        with torch.no_grad():
            finish_loading(m)
    finally:
        torch.set_default_dtype(prev)
    return m


def meta_model_cost(arch: ModelArch, quant: QuantConfig, kv_bytes_per_token: int) -> ModelCost:
    """The cost of a model of `arch` with weights in `quant` (see `meta_model`)."""
    return ModelCost.of(meta_model(arch, quant), kv_bytes_per_token)
