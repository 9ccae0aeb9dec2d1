"""Checkpoint tensors copied to the GPU through pinned host buffers, ahead of their loaders.

A tensor read from a safetensors file lives in the file's memory map (pageable memory); copied
straight into a CUDA parameter, it goes through the driver's own staging buffer one chunk at a
time, the host waiting on each: 6.6 GB/s for an 8B model on the H200 (bench/fast_start.py).
Here torch's CPU threads copy each tensor into one of two pinned buffers, and the device reads
it from there by DMA, asynchronously: the host fills one buffer while the device reads the
other. The loaders then copy device to device (their slices and shards as before); the stream
orders their copies after the DMA. One checkpoint tensor at a time is held on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

STAGE_BYTES = 64 << 20  # per buffer: DMA of one takes ~1.5 ms, long enough to hide the next copy


def to_device(weights: Iterable[tuple[str, torch.Tensor]], device: torch.device,
              stage_bytes: int = STAGE_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the tensor on `device`) for every (name, host tensor) of `weights`, in order."""
    buffers = [torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last DMA
    stream = torch.cuda.current_stream(device)  # the DMA's, and the loaders' copies after it
    i = 0
    try:
        for name, host in weights:
            out = torch.empty(host.shape, dtype=host.dtype, device=device)
            src = host.contiguous().reshape(-1).view(torch.uint8)  # [bytes]
            dst = out.reshape(-1).view(torch.uint8)  # [bytes]
            for start in range(0, src.numel(), stage_bytes):
                n = min(stage_bytes, src.numel() - start)
                event = copied[i]
                if event is not None:  # its previous bytes must have reached the device
                    event.synchronize()
                buf = buffers[i][:n]
                buf.copy_(src[start : start + n])
                dst[start : start + n].copy_(buf, non_blocking=True)
                event = copied[i] = torch.cuda.Event()
                event.record(stream)
                i ^= 1
            yield name, out
    finally:
        for event in copied:  # the buffers are freed only once the device has read them
            if event is not None:
                event.synchronize()
