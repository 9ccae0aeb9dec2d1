"""Host memory for the weights a CPU decode step streams: the tensors of a module copied, at
load, into one anonymous mapping advised to transparent huge pages (2 MiB).

A decode step reads each weight once from memory. In 4 KiB pages a thread's stream crosses a
page every 4 KiB and takes a TLB miss; in 2 MiB pages it crosses one every 2 MiB, and a small
weight (the default model's 576 x 576) shares its huge page with its layer's others. The
allocator gives huge pages only to what asks for them (Linux's `madvise` mode, the common
default), and torch's allocator does not ask: on a 2-core AMD EPYC VM the bf16 kernel read
7-30% faster from such a mapping (bench/cpu_bf16_speed.py's skyline_bf16_huge_pages rows).
Where the kernel has no transparent huge pages (`never`, not Linux) or SKYLINE_HUGE_PAGES=0,
tensors stay where they are.
"""

from __future__ import annotations

import functools
import mmap
from typing import Any

import torch

from skyline import envs

HUGE_PAGE = 2 << 20
_ALIGN = 64  # bytes between tensors of a mapping (a cache line)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether anonymous mappings can be advised to transparent huge pages here."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(mmap, "MADV_HUGEPAGE")


def _tensors(value: Any, out: dict[int, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if _movable(value):
            out[id(value)] = value
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, out)


def _movable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
            and t.is_contiguous() and t.numel() > 0 and not t.requires_grad)


def _replace(value: Any, moved: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return moved.get(id(value), value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)._make(_replace(v, moved) for v in value)
    if isinstance(value, (tuple, list)):
        return type(value)(_replace(v, moved) for v in value)
    return value


def _arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one mapping advised to huge pages, 2 MiB-aligned."""
    sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]
    total = -(-sum(sizes) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    mm = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping while a view lives
    at = -base.data_ptr() % HUGE_PAGE
    out = []
    for t, size in zip(tensors, sizes, strict=True):
        n = t.numel() * t.element_size()
        view = base[at:at + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        at += size
    return out


def into_huge_pages(items: list[tuple[Any, str]]) -> int:
    """Move the plain CPU tensors held as attribute `name` of each (owner, name) (a tensor, a
    tuple or NamedTuple of them, or a Parameter, whose data moves) into one huge-page mapping.
    Returns the bytes moved (0 where huge pages are not available or nothing was there)."""
    if not envs.ENV.huge_pages or not available():
        return 0
    found: dict[int, torch.Tensor] = {}  # by id of the tensor, or of the Parameter
    for owner, name in items:
        value = getattr(owner, name, None)
        if isinstance(value, torch.nn.Parameter):
            if _movable(value.data):
                found[id(value)] = value.data
        else:
            _tensors(value, found)
    if not found:
        return 0
    try:
        copies = _arena(list(found.values()))
    except (OSError, ValueError):  # no memory for the mapping, or no madvise: stay
        return 0
    moved = dict(zip(found, copies, strict=True))
    for owner, name in items:
        value = getattr(owner, name, None)
        if isinstance(value, torch.nn.Parameter):
            if id(value) in moved:
                value.data = moved[id(value)]
        elif value is not None:
            setattr(owner, name, _replace(value, moved))
    return sum(t.numel() * t.element_size() for t in found.values())
