"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k norms), and in
place of the MLP a sparse block on every layer but ModelArch.dense_layers (`mlp_only_layers`,
`decoder_sparse_step`): each token runs its top-k experts of a softmax over all of them,
their weights renormalized to sum to 1 when `norm_topk_prob`. Checkpoint names are HF's
(`mlp.gate`, `mlp.experts.<e>.{gate,up,down}_proj`)."""

from __future__ import annotations

from torch import nn

from skyline.config import ModelArch
from skyline.model.layers.mlp import MLP
from skyline.model.layers.moe import MoE
from skyline.model.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> nn.Module:
        if not arch.is_moe_layer(layer):
            return MLP(arch.hidden_size, arch.intermediate_size)
        scoring = "softmax_renorm" if arch.norm_topk_prob else "softmax"
        return MoE(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                   arch.num_experts_per_tok, scoring)
