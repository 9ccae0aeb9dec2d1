"""Programmatic dependent launch (PDL) for the Triton kernels of a step.

A batch-1 decode step of an 8B model is a chain of ~260 kernels, most of them a few
microseconds long. Between two kernels the GPU drains one grid before it schedules the next,
which costs about a microsecond even inside a CUDA graph. On Hopper and later, a kernel
launched with PDL is scheduled as soon as every program of its predecessor has signalled
(`griddepcontrol.launch_dependents`); its programs then wait at `griddepcontrol.wait` until the
predecessor has completed and its writes are visible. Every kernel here calls `pdl_wait` before
it touches global memory, so it reads nothing early and overwrites nothing its predecessor
still reads; the call also signals its own successor, keeping exactly one launch ahead. The one
exception is weights, which no kernel of a step writes: the integer-mode GEMVs load their first
weight tile before the wait, so its latency overlaps the end of the kernel before.

Launches without the attribute (torch ops, cuBLAS) keep their full-grid ordering, and a PDL
launch after one of them waits for its completion as usual, so the two kinds mix safely, also
in a captured CUDA graph. `SKYLINE_PDL=0` (or SKYLINE_UNFUSE=pdl) turns it off.
"""

from __future__ import annotations

import functools

import torch

from skyline import envs
from skyline.ops.triton_utils import interpreted, tl, triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = gdc_launch_dependents = None


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (NVIDIA, compute capability >= 9;
    not under SKYLINE_UNFUSE=pdl)."""
    return device.type == "cuda" and "pdl" not in envs.ENV.unfuse and _enabled(device.index)


@functools.cache
def _enabled(index: int | None) -> bool:
    if gdc_wait is None or torch.version.hip or interpreted() or not envs.ENV.pdl:
        return False  # (ROCm reports compute capabilities >= 9 too, without PDL)
    return torch.cuda.get_device_capability(index)[0] >= 9


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        # First thing a kernel does: wait for the previous grid, then let the next one launch.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:  # no kernel runs, so none calls it
    pdl_wait = None
