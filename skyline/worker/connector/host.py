"""The RAM tier's memory: `num_slots` block payloads in one host buffer per rank, numbered as
the scheduler's RAM index numbers them (cache/tiers.py). With a CUDA device the buffer is
page-locked, so copies to and from the device are asynchronous DMA at full link speed.

Pinning goes through cudaHostRegister on plain memory rather than PyTorch's pinned allocator,
which rounds every allocation up to a power of two (a 40 GiB tier would lock 64 GiB).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger(__name__)


class HostBuffer:
    def __init__(self, num_slots: int, payload_bytes: int, pin: bool) -> None:
        self.num_slots = num_slots
        self.payload_bytes = payload_bytes
        self.data = torch.empty((num_slots, payload_bytes), dtype=torch.uint8)  # [slot, bytes]
        self.pinned = pin and _register(self.data)
        self._np = self.data.numpy()

    def view(self, slot: int) -> memoryview:
        """The slot's bytes, for file I/O (no copy)."""
        return memoryview(self._np[slot])

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False


def _register(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return False
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if err != 0:
        log.warning("could not page-lock %.1f GiB of host memory for the KV tiers (CUDA error "
                    "%d): copies to and from it are synchronous", t.numel() / 2**30, err)
        return False
    return True


def runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive stretches of `slots`: (first index in the list, first slot, length), so
    that each stretch is one copy."""
    if not slots:
        return []
    a = np.asarray(slots)
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(a)]))
    return [(int(s), int(a[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]
