"""Triton, where it is installed. CPU-only installs of PyTorch do not bring it: then `triton`
and `tl` are None, every module defines its kernels under `if triton is not None`, and the
dispatchers run their PyTorch references."""

from __future__ import annotations

from typing import Any

from skyline import envs

triton: Any
tl: Any
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def interpreted() -> bool:
    """Whether kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return envs.ENV.triton_interpret
