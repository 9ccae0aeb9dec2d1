"""GGUF rope metadata -> HF `rope_scaling`: linear and yarn keys, and Llama 3.1's `rope_freqs`
tensor turned back into the llama3 parameters it was computed from."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from skyline.config import ConfigError


def f32(x: float) -> float:
    # GGUF stores floats as float32; give the shortest decimal that round-trips (1e-05, not
    # 9.999999747378752e-06), as the original config.json had it.
    return float(str(np.float32(x)))


def rope_scaling_from_gguf(
    value: Callable[[str], Any], path: str, theta: float, head_dim: int,
    rope_freqs: np.ndarray | None,
) -> dict[str, Any] | None:
    """HF rope_scaling from `{arch}.rope.*` metadata (value(key) reads `{arch}.{key}`) and the
    `rope_freqs` tensor, if the file has one."""
    kind = value("rope.scaling.type")
    factor = value("rope.scaling.factor") or value("rope.scale_linear")  # the latter: old files
    if rope_freqs is not None:  # Llama 3.1+: llama3 scaling, stored as per-pair divisors
        n_rot = int(value("rope.dimension_count") or head_dim)
        return llama3_scaling_from_factors(rope_freqs, theta, n_rot)
    if kind in (None, "none") and not factor:
        return None
    if kind == "linear" or (kind is None and factor):
        return {"rope_type": "linear", "factor": f32(factor)}
    if kind == "yarn":
        orig = value("rope.scaling.original_context_length")
        out: dict[str, Any] = {"rope_type": "yarn", "factor": f32(factor or 1.0)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            beta = value(f"rope.scaling.{key}")
            if beta is not None:
                out[hf_key] = f32(beta)
        attn = value("rope.scaling.attn_factor")
        if attn is not None and abs(attn - 1.0) > 1e-6 and out["factor"] > 1:
            # llama.cpp multiplies its default mscale by attn_factor; HF's attention_factor
            # replaces the default, so fold the default in.
            out["attention_factor"] = f32(attn * (0.1 * math.log(out["factor"]) + 1.0))
        return out
    raise ConfigError(
        f"{path} uses rope scaling {kind!r}, which skyline does not support; "
        "supported: linear, yarn, llama3 (rope_freqs)"
    )


def llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, dim: int
) -> dict[str, Any] | None:
    """HF llama3 rope_scaling from llama.cpp's `rope_freqs` tensor (factors that divide each
    inverse frequency).

    The factors are 1 for short wavelengths, `factor` for long ones, and in between
    1 / ((1 - s) / factor + s) with s = (orig / wavelen - low) / (high - low): s is linear in
    1 / wavelen, and a line fit over the middle band gives orig / (high - low) and
    low / (high - low). Only those ratios are determined, so low_freq_factor is taken as 1
    (every Llama 3.x uses 1), which recovers the published (8192, 1, 4) exactly. The result is
    checked by recomputing the factors; if they do not match, the factors are passed as
    {"rope_type": "freq_factors", "freq_factors": [...]} for a rotary layer that divides by them.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / inv_freq
    if len(factors) == len(wavelen):
        mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
        if mid.sum() >= 2:
            s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
            slope, intercept = np.polyfit(1 / wavelen[mid], s, 1)
            if intercept < 0:
                low = 1.0
                high = round(1 - 1 / intercept, 4)
                orig = int(round(slope * (high - low)))
                scaling = {
                    "rope_type": "llama3",
                    "factor": f32(factor),
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": orig,
                }
                if np.allclose(_llama3_factors(scaling, wavelen), factors, rtol=1e-4):
                    return scaling
    return {"rope_type": "freq_factors", "factor": f32(factor),
            "freq_factors": [float(f) for f in factors]}


def _llama3_factors(s: dict[str, Any], wavelen: np.ndarray) -> np.ndarray:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    orig = s["original_max_position_embeddings"]
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))
