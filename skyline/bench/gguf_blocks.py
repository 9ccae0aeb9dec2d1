"""Random GGUF blocks for benchmarks and tests: every byte random except the fp16 scales,
which are drawn from a finite range (random bytes there would make NaN, Inf or huge scales)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# byte offsets of the fp16 scales in each block type (ggml type id)
FP16_AT: dict[int, list[int]] = {
    2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0],  # Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
    10: [80, 82], 11: [108], 12: [0, 2], 13: [0, 2], 14: [208],  # Q2_K .. Q6_K
}


def random_blocks(qtype: int, rows: int, cols: int, seed: int = 0,
                  scale: float = 0.05) -> torch.Tensor:
    """[rows, bytes_per_row] uint8 of `qtype` blocks with fp16 scales uniform in
    [-scale, scale]; cols a multiple of the type's block size."""
    qtype = int(qtype)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    rng = np.random.default_rng(seed)
    n = rows * cols // block_size
    b = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        b[:, at : at + 2] = rng.uniform(-scale, scale, n).astype(np.float16).view(np.uint8) \
            .reshape(n, 2)
    return torch.from_numpy(b.reshape(rows, -1).copy())
