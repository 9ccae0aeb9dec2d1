"""The attention layer: stores this step's k/v in the paged KV cache, then attends over it.

What each token attends to comes from the per-forward context (`forward_ctx`), set by the
runner; the layer holds only its KV cache tensor and, for an fp8 cache, its K and V scales
(ops/kv_quant.py), which the runner binds after allocating the cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.model.forward_ctx import AttentionMetadata, get_forward_context
from skyline.ops.attention import attend_ref, causal_mask, paged_attention
from skyline.ops.cpu_attention import decode_attention_cpu, decode_gather
from skyline.ops.gemv_int_a8 import Int8Chunks
from skyline.ops.kv_quant import dequantize_kv, is_fp8, quantize_kv
from skyline.ops.kv_write import KVWrite, write_kv
from skyline.parallel.groups import ParallelLayout
from skyline.parallel.shard import head_shard


def cpu_gather(meta: AttentionMetadata, block_size: int) -> Any:
    """The CPU decode attention's gather of the step's decodes (ops/cpu_attention.py), made
    once per step by the first layer that needs it and kept on the metadata."""
    if meta.cpu_gather is None:
        n = meta.num_decodes
        lens = None if meta.seq_lens_tensor is None else meta.seq_lens_tensor[:n]
        meta.cpu_gather = decode_gather(meta.seq_lens[:n], meta.block_tables[:n], block_size,
                                        lens)
    return meta.cpu_gather


class Attention(nn.Module):
    """q [T, H, D], k/v [T, KVH, D] -> [T, H * D].

    With a forward context and a bound cache: k/v go to `slot_mapping` and each sequence's
    queries attend causally over its cached context. With a context but no cache yet (a
    profiling run): each sequence attends causally over its own tokens only. With no context
    (a bare test, or scoring a text): all tokens are one sequence, causal; if an fp8 cache is
    bound, k/v are first rounded as the cache would hold them, so a score reflects what serving
    computes.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 feeds: Any = None, sliding_window: int = 0, sinks: bool = False) -> None:
        """`feeds`: the Linear that takes the output (o_proj): where it takes its input rounded
        to int8 (Linear.input_quant), a decode batch whose KV splits a kernel combines comes out
        rounded already. `sliding_window` > 0: a query sees only the keys less than that many
        positions before it. `sinks` (gpt-oss): a learned logit per head (the parameter
        `sinks`, [num_heads]) joins every softmax's denominator."""
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
        self.sliding_window = sliding_window
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the runner
        self.kv_cache: torch.Tensor | None = None
        # The cache holds k / k_scale and v / v_scale: float32 values, 1.0 unless it is fp8.
        # Fixed once bound (CUDA graphs capture them as kernel constants).
        self.k_scale = 1.0
        self.v_scale = 1.0
        # The consumer's question, not the consumer (a module attribute would register it twice)
        self._input_quant = feeds.input_quant if feeds is not None else None

    def shard(self, layout: ParallelLayout) -> None:
        """Attend with this rank's heads (those its QKVLinear projects)."""
        if layout.tp.size > 1:
            h = head_shard(self.num_heads, self.num_kv_heads, layout.tp.size, layout.tp.index)
            if self.sinks is not None:  # this rank's heads' sinks, from the checkpoint's all
                self.sinks = nn.Parameter(torch.empty(h.num_q), requires_grad=False)
                self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
                self._sink_rows = (h.q_start, h.num_q, self.num_heads)
            self.num_heads, self.num_kv_heads = h.num_q, h.num_kv

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: Any = None) -> None:
        start, n, total = self._sink_rows
        if loaded.shape != (total,):
            raise ConfigError(f"sinks of {tuple(loaded.shape)} where ({total},) was expected")
        param.data.copy_(loaded[start : start + n])

    def checkpoint_shape(self, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
        """The shape of the checkpoint tensor that fills `param` (all heads' sinks)."""
        rows = getattr(self, "_sink_rows", None)
        return (rows[2],) if rows is not None and param is self.sinks else tuple(param.shape)

    def kv_write(self, v: torch.Tensor) -> KVWrite | None:
        """Where this forward's k and v go in the cache, for a rope kernel to store them on the
        way (then `forward(..., kv_written=True)`); None without a forward context or cache."""
        meta = get_forward_context()
        if meta is None or self.kv_cache is None:
            return None
        return KVWrite(v, self.kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_written: bool = False,  # k and v are already in the cache (see kv_write)
    ) -> torch.Tensor | Int8Chunks:  # [num_tokens, num_heads * head_dim]
        """Where the Linear this feeds takes int8 input, a pure decode batch whose KV splits are
        combined by a kernel comes out rounded for the W4A8 GEMV, as Int8Chunks; every other
        case returns the plain output (the GEMV then rounds it itself)."""
        meta = get_forward_context()
        if meta is None:
            if self.kv_cache is not None and is_fp8(self.kv_cache):
                k = dequantize_kv(quantize_kv(k, self.kv_cache.dtype, self.k_scale), k.dtype,
                                  self.k_scale)
                v = dequantize_kv(quantize_kv(v, self.kv_cache.dtype, self.v_scale), v.dtype,
                                  self.v_scale)
            out = self._causal(q, k, v)
        elif self.kv_cache is None:
            out = self._varlen_no_cache(q, k, v, meta)
        else:
            if not kv_written:
                write_kv(k, v, self.kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            if meta.num_decodes and not self.kv_cache.is_cuda:
                cpu_gather(meta, self.kv_cache.shape[2])
                if (meta.num_decodes == q.shape[0] and not self.sliding_window
                        and self.sinks is None):
                    # a pure decode batch: paged_attention's CPU path, called directly (a CPU
                    # decode step is bound by what Python dispatches)
                    return decode_attention_cpu(q, self.kv_cache, meta.cpu_gather, self.scale,
                                                self.k_scale, self.v_scale).flatten(1, 2)
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
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                int8_out=self._wants_int8(q),
                window=self.sliding_window,
                sinks=self.sinks,
                cpu_gather=meta.cpu_gather,
                mixed=meta.mixed,
            )
            if isinstance(out, Int8Chunks):
                return out
        return out.flatten(1, 2)

    def _wants_int8(self, q: torch.Tensor) -> bool:
        return (self._input_quant is not None
                and self._input_quant(q.flatten(1)) == "int8")  # asks with o_proj's input shape

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.sliding_window == 0 and self.sinks is None:
            # On CUDA with a batch dimension: SDPA's fused kernels take only 4-D inputs, and the
            # math kernel it falls back to holds the whole [H, T, T] score matrix (4 GiB in
            # bf16 for the start-up profile's 8,192 tokens of an 8B model, counted against the
            # KV cache). The CPU keeps the math kernel: its numbers are what the tests pin.
            qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H or KVH, T, D]
            if q.is_cuda:
                qh, kh, vh = qh[None], kh[None], vh[None]
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads)
            return (o[0] if q.is_cuda else o).transpose(0, 1)  # [T, H, D]
        n = q.shape[0]
        mask = causal_mask(0, n, self.sliding_window, q.device) if self.sliding_window else None
        o = attend_ref(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask,
                       self.scale, self.sinks, causal=True)
        return o.transpose(0, 1)

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
            + (f", window={self.sliding_window}" if self.sliding_window else "")
            + (", sinks" if self.sinks is not None else "")
            + (f", k_scale={self.k_scale:.4g}, v_scale={self.v_scale:.4g}"
               if self.k_scale != 1.0 or self.v_scale != 1.0 else "")
        )
