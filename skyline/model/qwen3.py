"""Qwen3: Llama with an RMSNorm over each head of q and k, applied before rope."""

from __future__ import annotations

import torch

from skyline.config import ModelArch
from skyline.model.layers.norm import RMSNorm
from skyline.model.layers.rotary import RotaryEmbedding
from skyline.model.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding) -> None:
        super().__init__(arch, rotary)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim]: normed over head_dim
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
