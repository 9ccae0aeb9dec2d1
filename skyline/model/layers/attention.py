"""The attention layer: stores this step's k/v in the paged KV cache, then attends over it.

What each token attends to comes from the per-forward context (`forward_ctx`), set by the
runner; the layer holds only its KV cache tensor, which the runner binds after allocating it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.model.forward_ctx import AttentionMetadata, get_forward_context
from skyline.ops.attention import paged_attention, write_kv_ref


class Attention(nn.Module):
    """q [T, H, D], k/v [T, KVH, D] -> [T, H * D].

    With a forward context and a bound cache: k/v go to `slot_mapping` and each sequence's
    queries attend causally over its cached context. With a context but no cache yet (a
    profiling run): each sequence attends causally over its own tokens only. With no context
    (a bare test): all tokens are one sequence, causal.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads}; config.json is inconsistent"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the runner
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        meta = get_forward_context()
        if meta is None:
            out = self._causal(q, k, v)
        elif self.kv_cache is None:
            out = self._varlen_no_cache(q, k, v, meta)
        else:
            # Torch reference path; a fused kernel for CUDA plugs in here.
            write_kv_ref(k, v, self.kv_cache, meta.slot_mapping)
            out = paged_attention(
                q,
                self.kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                self.scale,
                num_decodes=meta.num_decodes,
                seq_lens_tensor=meta.seq_lens_tensor,
                query_start_loc_tensor=meta.query_start_loc_tensor,
            )
        return out.flatten(1, 2)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [H, T, D]
            k.transpose(0, 1),  # [KVH, T, D]
            v.transpose(0, 1),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.transpose(0, 1)  # [T, H, D]

    def _varlen_no_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        loc = meta.query_start_loc
        for i in range(meta.num_seqs):
            s, e = loc[i], loc[i + 1]
            out[s:e] = self._causal(q[s:e], k[s:e], v[s:e])
        return out

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, scale={self.scale:.4g}"
        )
