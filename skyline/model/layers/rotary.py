"""Rotary position embedding (NeoX / rotate-half layout, as HF Llama) with a cos/sin cache.

Inverse frequencies follow HF transformers' ROPE_INIT_FUNCTIONS exactly (same float32 ops
in the same order), so fp32 logits match HF bit for bit up to the attention kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from skyline.config import ConfigError
from skyline.ops.kv_write import KVWrite, write_kv
from skyline.ops.rotary import rotary_cpu, rotary_embedding, rotation_operands


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    # [dim // 2] float32 on CPU, computed as HF does
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponent)


def _default(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(dim, base), 1.0


def _linear(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(dim, base) / s["factor"], 1.0


def _dynamic(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    # HF recomputes the base only once a sequence grows past max_position_embeddings; the cache
    # never holds positions beyond it, so within range dynamic NTK equals the plain frequencies.
    return _base_inv_freq(dim, base), 1.0


def _llama3(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(dim, base)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig
    attn_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attn_factor is None:
        if mscale and mscale_all_dim:
            attn_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attn_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    idx = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((idx - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attn_factor)


_InvFreqFn = Callable[[int, float, dict[str, Any], int], tuple[torch.Tensor, float]]
ROPE_TYPES: dict[str, _InvFreqFn] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token positions (rotate-half over the full head_dim)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        rope_type = rope_type_of(scaling)
        if rope_type not in ROPE_TYPES:
            supported = ", ".join(ROPE_TYPES)
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported; skyline supports: {supported}"
            )
        scaling = dict(scaling or {})
        inv_freq, attn_scale = ROPE_TYPES[rope_type](head_dim, base, scaling, max_position)
        if rope_type == "yarn":
            orig = scaling["original_max_position_embeddings"]
            max_position = max(max_position, int(orig * (scaling.get("factor") or 1)))
        self.head_dim = head_dim
        self.max_position = max_position
        self._inv_freq, self._attn_scale = inv_freq, attn_scale
        # Built on the default device, in float32. On the meta device (the loader builds there,
        # then `materialize`s) only its shape: meta arithmetic runs torch's Python reference
        # ops, whose first use imports seconds of torch.
        table = torch.empty(max_position, head_dim) if torch.empty(0).is_meta else \
            self._table(max_position, None)
        self.register_buffer("cos_sin_cache", table, persistent=False)
        self._rot_key: tuple[torch.Tensor | None, torch.dtype | None] = (None, None)
        self._rot = (torch.empty(0), torch.empty(0))

    def _table(self, n: int, device: torch.device | None) -> torch.Tensor:  # [n, head_dim]
        t = torch.arange(n, dtype=torch.float32, device=device)
        freqs = t[:, None] * self._inv_freq.to(t.device)[None, :]  # [n, head_dim // 2]
        s = self._attn_scale
        return torch.cat((freqs.cos() * s, freqs.sin() * s), dim=-1)

    def materialize(self, device: torch.device) -> None:
        """Compute the table on `device` (for a model built on the meta device)."""
        self.cos_sin_cache = self._table(self.max_position, device)

    def extend(self, num_positions: int) -> None:
        """Cover positions up to `num_positions` (a context beyond the trained one, which the
        user asked for); the rotation of each position stays the same."""
        if num_positions > self.max_position:
            self.cos_sin_cache = self._table(num_positions, self.cos_sin_cache.device)
            self.max_position = num_positions

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv: KVWrite | None = None,  # also store k and kv.v in the KV cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by their positions; on CUDA in place (one kernel, which also writes
        the cache when given `kv`), and returned."""
        if q.device.type == "cpu":
            q, k = rotary_cpu(*self._operands(positions, q.dtype), q, k)
            if kv is not None:
                write_kv(k, kv.v, kv.kv_cache, kv.slot_mapping, kv.k_scale, kv.v_scale)
            return q, k
        return rotary_embedding(positions, q, k, self.cos_sin_cache, kv=kv)

    def _operands(self, positions: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a forward pass rotates by the same positions tensor: its operands are
        # made once (the tensor is held, so a later one cannot reuse its id).
        if self._rot_key[0] is not positions or self._rot_key[1] != dtype:
            self._rot = rotation_operands(positions, self.cos_sin_cache, dtype)
            self._rot_key = (positions, dtype)
        return self._rot

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"
