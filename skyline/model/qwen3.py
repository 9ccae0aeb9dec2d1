"""Qwen3: Llama with an RMSNorm over each head of q and k, applied before rope (both by one
kernel on CUDA, in place on the qkv projection's output)."""

from __future__ import annotations

import torch

from skyline.config import ModelArch
from skyline.model.layers.norm import RMSNorm
from skyline.model.layers.rotary import RotaryEmbedding
from skyline.model.llama import LlamaAttention, LlamaForCausalLM
from skyline.ops.kv_write import KVWrite
from skyline.ops.norm import CPU_FEW_ROWS, rms_norm_cpu
from skyline.ops.rotary import qk_norm_rotary


class Qwen3Attention(LlamaAttention):
    qk_norm = True

    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__(arch, rotary, layer)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    kv: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # q and k normed over head_dim (each with its own weight), then rotated
        if q.device.type == "cpu" and q.shape[0] <= CPU_FEW_ROWS:  # as layers/cpu_decode.py
            q, k = (rms_norm_cpu(q, self.q_norm.weight, self.q_norm.eps),
                    rms_norm_cpu(k, self.k_norm.weight, self.k_norm.eps))
            return self.rotary_emb(positions, q, k, kv)
        return qk_norm_rotary(positions, q, k, self.rotary_emb.cos_sin_cache, self.q_norm.weight,
                              self.k_norm.weight, self.q_norm.eps, kv=kv)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
