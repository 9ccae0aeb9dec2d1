"""The block tables of the paged-attention tests: each sequence's pages at shuffled block ids
(never block 0, which the tests fill with NaN: table padding points there)."""

from __future__ import annotations

import random

import torch


def shuffled_table(seq_lens: list[int], page: int, num_blocks: int,
                   rng: random.Random) -> torch.Tensor:
    """[len(seq_lens), max pages] int32 on the CPU; padding is block 0."""
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    table = torch.zeros(len(seq_lens), max(-(-n // page) for n in seq_lens), dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        nb = -(-n // page)
        table[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)])
    return table
