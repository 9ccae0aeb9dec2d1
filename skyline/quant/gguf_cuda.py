"""The CUDA form of a GGUF layer (quant/gguf.py's docstring says which runs take which): runs
of Q6_K / Q5_K kept as raw blocks for ops/gemv_block.py, the other runs of integer codes in
ops/int_matmul.py's group-wise layout, float types dense. Made at the layer's first CUDA call;
the kernels also run in Triton's interpreter, where the tests call them on CPU tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from skyline.ops.block_linear import gguf_linear
from skyline.ops.dequant import AFFINE_GROUP, INT4_GROUP_TYPES, affine_groups, dequantize_ref
from skyline.ops.gemv_block import GGUF_FORMATS
from skyline.ops.int_matmul import dequantize_int_ref
from skyline.ops.triton_utils import triton
from skyline.quant.base import int_codes_linear, pack_nibbles
from skyline.quant.method import LinearLayer


def dequantize_blocks(layer: LinearLayer) -> torch.Tensor:
    """The layer's runs of raw blocks dequantized (ops/dequant.py), float32 [out, in]."""
    ws = [dequantize_ref(getattr(layer, f"gguf_w{i}"), qtype)
          for i, qtype in enumerate(layer.gguf_types)]
    return ws[0] if len(ws) == 1 else torch.cat(ws)



def _cuda_ready(layer: LinearLayer, dtype: torch.dtype) -> bool:
    """Makes the layer's CUDA form at its first call (an eager one: the engine's profiling run
    comes before any graph capture): with a run of Q6_K / Q5_K and Triton, `gguf_segments`
    (_make_segments); else the integer layout (`gguf_qweight`, `gguf_scales`, `gguf_zeros`,
    `gguf_bits_group`), or dense weights in `dtype` for float types; the raw blocks are
    dropped."""
    if hasattr(layer, "gguf_segments"):
        return True
    if not (hasattr(layer, "gguf_qweight") or hasattr(layer, "gguf_dense")):
        if _make_segments(layer):
            return True
        layout = int_layout(layer)
        if layout is None:
            layer.register_buffer("gguf_dense", dequantize_blocks(layer).to(dtype))
        else:
            for name, t in zip(("gguf_qweight", "gguf_scales", "gguf_zeros"), layout[:3],
                               strict=True):
                layer.register_buffer(name, t)
            layer.gguf_bits_group = layout[3:]
        for i in range(len(layer.gguf_types)):
            delattr(layer, f"gguf_w{i}")
    return True


def _int_apply(layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
    """x through the CUDA form _cuda_ready made (the kernels; Triton's interpreter on CPU)."""
    if hasattr(layer, "gguf_segments"):
        return _segments_apply(layer, x)
    if not hasattr(layer, "gguf_qweight"):
        return F.linear(x, layer.gguf_dense.to(x.dtype), layer.bias)
    return int_codes_linear(x, layer.gguf_qweight, layer.gguf_scales, layer.gguf_zeros,
                            *layer.gguf_bits_group, bias=layer.bias)


def cuda_weight(layer: LinearLayer) -> torch.Tensor | None:
    """float32 [out, in] read back from the integer CUDA forms (segments or the integer
    layout); None if the layer has neither."""
    if hasattr(layer, "gguf_segments"):
        return torch.cat([_segment_weight(layer, seg) for seg in layer.gguf_segments])
    if hasattr(layer, "gguf_qweight"):
        w = dequantize_int_ref(layer.gguf_qweight, layer.gguf_scales, layer.gguf_zeros,
                               *layer.gguf_bits_group)
        return w[:, : layer.in_features]
    return None


# One part of a layer's CUDA form, a slice of its output rows [start, stop): ("raw", i, qtype)
# reads the run's blocks gguf_w{i} with the block kernels; ("int", j, bits, group) the integer
# layout gguf_q{j}, gguf_s{j}, gguf_z{j} of one or more neighbouring runs.
Segment = tuple[Any, ...]


def _make_segments(layer: LinearLayer) -> bool:
    """A layer with a run of Q6_K or Q5_K (and integer codes in every run), where Triton is:
    those runs keep their raw blocks, each other stretch of runs becomes one integer layout
    (int_layout) whose raw blocks are dropped. Returns whether it did (`gguf_segments`, each
    with its rows)."""
    types = [int(t) for t in layer.gguf_types]
    if (triton is None or not any(t in GGUF_FORMATS for t in types)
            or not all(t in AFFINE_GROUP for t in types)):
        return False
    segments: list[tuple[int, int, Segment]] = []
    start, pending = 0, []  # runs waiting to become one integer layout

    def flush(start: int) -> int:
        if not pending:
            return start
        j = sum(1 for *_, seg in segments if seg[0] == "int")
        runs = [(getattr(layer, f"gguf_w{i}"), types[i]) for i in pending]
        q, sc, z, bits, group = int_layout_runs(runs)
        for name, t in zip(("q", "s", "z"), (q, sc, z), strict=True):
            layer.register_buffer(f"gguf_{name}{j}", t)
        segments.append((start, start + q.shape[0], ("int", j, bits, group)))
        for i in pending:
            delattr(layer, f"gguf_w{i}")
        pending.clear()
        return start + q.shape[0]

    for i, t in enumerate(types):
        if t in GGUF_FORMATS:
            start = flush(start)
            rows = getattr(layer, f"gguf_w{i}").shape[0]
            segments.append((start, start + rows, ("raw", i, t)))
            start += rows
        else:
            pending.append(i)
    flush(start)
    layer.gguf_segments = segments
    return True


def _segment_weight(layer: LinearLayer, segment: tuple[int, int, Segment]) -> torch.Tensor:
    """float32 [rows, in_features] of one segment."""
    seg = segment[2]
    if seg[0] == "raw":
        return dequantize_ref(getattr(layer, f"gguf_w{seg[1]}"), seg[2])
    j = seg[1]
    w = dequantize_int_ref(getattr(layer, f"gguf_q{j}"), getattr(layer, f"gguf_s{j}"),
                           getattr(layer, f"gguf_z{j}"), seg[2], seg[3])
    return w[:, : layer.in_features]


def _segments_apply(layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
    """x [..., in_features] through the layer's segments, each on its kernel, joined."""
    outs = []
    for start, stop, seg in layer.gguf_segments:
        bias = None if layer.bias is None else layer.bias[start:stop]
        if seg[0] == "raw":
            outs.append(gguf_linear(x, getattr(layer, f"gguf_w{seg[1]}"), seg[2], bias))
        else:
            j = seg[1]
            outs.append(int_codes_linear(x, getattr(layer, f"gguf_q{j}"),
                                         getattr(layer, f"gguf_s{j}"),
                                         getattr(layer, f"gguf_z{j}"), seg[2], seg[3],
                                         bias=bias))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def int_layout(
    layer: LinearLayer,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None:
    """The layer's blocks as (qweight, scales, zeros, bits, group) in ops/int_matmul.py's
    layout with float32 zeros, the same weights (W = q * s + o = (q - z) * s, z = -o / s);
    None if a run is not a type of integer codes. Runs of different group sizes share the
    smaller group (a group of 32 repeats its scale and zero over two of 16)."""
    types = [int(t) for t in layer.gguf_types]
    if not all(t in AFFINE_GROUP for t in types):
        return None
    return int_layout_runs([(getattr(layer, f"gguf_w{i}"), t) for i, t in enumerate(types)])


def int_layout_runs(
    runs: list[tuple[torch.Tensor, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """int_layout of runs (raw blocks, ggml type) of integer-code types, stacked."""
    types = [t for _, t in runs]
    parts = [affine_groups(data, t) for data, t in runs]
    group = min(p[3] for p in parts)
    bits = 4 if all(t in INT4_GROUP_TYPES for t in types) else 8
    q = torch.cat([p[0] for p in parts])
    s = torch.cat([p[1].repeat_interleave(p[3] // group, 1) for p in parts])
    o = torch.cat([p[2].repeat_interleave(p[3] // group, 1) for p in parts])
    # A group whose scale is 0 holds the constant o: codes 0, scale 1, zero -o.
    flat = s == 0
    z = torch.where(flat, -o, -o / torch.where(flat, torch.ones_like(s), s))
    s = torch.where(flat, torch.ones_like(s), s)
    q = torch.where(flat.repeat_interleave(group, 1), torch.zeros_like(q), q)
    if bits == 4:
        q = pack_nibbles(q)
    return q.contiguous(), s.contiguous(), z.contiguous(), bits, group
