"""A context beyond the trained one: the rotary table grows, each position's rotation unchanged."""

from __future__ import annotations

import pytest
import torch

from skyline.model.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}])
def test_extend_keeps_rotations(scaling):
    short = RotaryEmbedding(32, 128, 10000.0, scaling)
    long = RotaryEmbedding(32, 128, 10000.0, scaling)
    long.extend(300)
    assert long.cos_sin_cache.shape == (300, 32)
    torch.testing.assert_close(long.cos_sin_cache[:128], short.cos_sin_cache)
    # position p's angles are p * inv_freq, past the old end too
    ang = long.cos_sin_cache[299, :16].acos()
    ref = (299 * short._inv_freq.float()).cos().acos()
    torch.testing.assert_close(ang, ref, atol=1e-3, rtol=0)
    long.extend(200)  # never shrinks
    assert long.cos_sin_cache.shape[0] == 300
