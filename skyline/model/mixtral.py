"""Mixtral (MixtralForCausalLM): Mistral's attention (its sliding window where config.json sets
one) and a sparse block on every layer: each token runs its top-k experts of a softmax over all
of them, renormalized to sum to 1. HF names its block `block_sparse_moe` and its experts'
projections w1 (gate), w3 (up) and w2 (down); they load into the shared names."""

from __future__ import annotations

from torch import nn

from skyline.config import ModelArch
from skyline.model.layers.moe import MoE
from skyline.model.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    renames = (
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    )

    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> nn.Module:
        return MoE(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                   arch.num_experts_per_tok, "softmax_renorm")
