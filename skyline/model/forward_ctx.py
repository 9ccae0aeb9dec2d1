"""The one global: per-forward attention metadata, set by the runner with a `with` block and
read by every Attention layer of that forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and what each sequence attends to.

    Tokens of all scheduled sequences are flattened: sequence i owns tokens
    query_start_loc[i]:query_start_loc[i+1] and, after this step, has seq_lens[i] tokens of KV.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs] context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, 0-padded
    block_size: int
    # Sequences [0, num_decodes) have exactly one query token; the rest are prefills/extends.
    num_decodes: int = 0
    seq_lens_tensor: torch.Tensor | None = None  # [num_seqs] int32, on the device
    query_start_loc_tensor: torch.Tensor | None = None  # [num_seqs + 1] int32, on the device
    # CPU: the decodes' cache gather (ops/cpu_attention.DecodeGather), made by the first
    # attention layer of the step and read by the others
    cpu_gather: Any = None
    # A CUDA graph of mixed steps (worker/cuda_graph.py): the host lists and num_decodes
    # above are the capture's, not the replayed step's, so attention reads the device tensors
    # only (ops/attention.paged_mixed_attention) and nothing else may read the lists.
    mixed: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


_CONTEXT: AttentionMetadata | None = None


@contextmanager
def forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, meta
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> AttentionMetadata | None:
    """The metadata of the forward pass in progress (None outside one, e.g. a bare test)."""
    return _CONTEXT
