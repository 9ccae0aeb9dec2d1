"""GGUF weights kept packed: a Linear holds the file's raw blocks (Q4_1, Q6_K, ... as stored),
so the model takes about as much memory as the file, as in llama.cpp.

Matmuls: on the CPU with bfloat16 activations, a layer whose blocks all have an affine map per
32 elements runs torch's int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`), which reads 5
bits per weight (4-bit codes, a bf16 scale and zero per 32) and unpacks in registers: 4-bit
codes (Q4_0, Q4_1, Q4_K) as one plane, 5- to 8-bit codes (Q5_0, Q5_1, Q5_K, Q8_0) as two, low
and high nibbles (W = lo * s + 16 s * hi + o: two kernel calls, 10 bits a weight). The repacked
weights are made at the first such call and replace the raw blocks, which are dropped (scale and
offset per 32 elements stored in bfloat16, so within bf16 rounding of the file's fp16 scales);
from then on the layer runs every input on that kernel (other dtypes through bfloat16), and
`dequantized_weight` reads the weights back from it. A layer with types of 16-element groups
(Q6_K, Q2_K, Q3_K: the kernel takes groups of 32 or more) is dequantized once to bfloat16 at its
first bfloat16 call instead, its raw blocks dropped: 16 bits a weight rather than the file's
2.6-6.6, because dequantizing whole blocks at every call makes decode 4-5x slower. Float32
keeps the raw blocks and dequantizes them with ops/dequant.py at each call, exact.

A CPU engine (the default for a GGUF file on a CPU whose plan runs the int4 kernel,
ops/cpu_plan.py) does not take those lazy paths: `prepack_cpu` builds its serving layout at
load, by the plan: the int4 kernel's planes where the plan runs this layer's codes on it
(decode-sized batches: up to `int4_rows` rows, 4-bit codes; `int4_wide_rows` for 5- to 8-bit
codes) or, for 5- to 8-bit codes where the plan has `intdot_rows`, the integer dot-product
kernel's codes (ops/cpu_intdot.py: the file's codes in 4, 6 or 8 bits with an fp16 scale
and offset per 16 or 32, or for the K types the file's own scales, an integer per group and a
factor per 256; activations rounded to int8 per 32 as the plan rounds them), and the
weights dequantized once to the model dtype and packed for oneDNN (prefill and many streams,
where the int4 kernel's time grows with the rows and a dense product's barely does). The raw
blocks are dropped; memory is the planes plus the dense copy (the default model's Linears in
bfloat16: 63 + 203 MiB, against 405 MiB dequantized to float32). A GGUF file's MoE experts keep
their blocks too, and a CPU runs them on the integer dot kernel (quant/gguf_experts.py).

On CUDA, a layer's first call makes its serving form. Runs of Q6_K and Q5_K keep their raw
blocks (6.56 and 5.5 bits a weight): decode-sized batches run the block GEMV of
ops/gemv_block.py on the super-blocks as stored, larger ones dequantize them 32 MiB of rows at a
time into one scratch buffer shared by every layer (ops/block_linear.SCRATCH_BYTES: 32 MiB per
device and dtype in all) and run a matmul per chunk.
The other runs become the group-wise integer layout of ops/int_matmul.py (every block type with
integer codes: W = (q - zero) * scale per group, the zero a float32 so that any affine map of
the file is kept; 4-bit codes when all of those runs are Q4_0 / Q4_1 / Q4_K, groups of 32, else
8-bit codes in groups of 32 or 16) and drop their raw blocks: decode-sized batches run the
quantized GEMV of ops/gemv_quant.py, larger ones the Triton dequant-matmul. That is 6 bits a
weight for the 4-bit types and 10-12 for Q5_0, Q5_1, Q8_0, Q2_K and Q3_K (the file's 2.6-8.5),
against 16 dense; float types (F16, BF16, F32) go dense once. A layer of mixed runs (Q4_K_M's
attn_v in Q6_K beside Q4_K q and k) runs each part on its own kernel and joins the outputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline import envs
from skyline.config import ConfigError
from skyline.ops import cpu_bf16, cpu_ext, cpu_int4, cpu_intdot, cpu_linear, cpu_plan
from skyline.ops.dequant import (
    AFFINE_GROUP,
    GGML_TYPES,
    INT4_GROUP_TYPES,
    SUPER_GROUP_TYPES,
    affine_groups,
    super_groups,
)
from skyline.quant.gguf_cuda import _cuda_ready, _int_apply, cuda_weight, dequantize_blocks
from skyline.quant.gguf_cuda import int_layout as int_layout
from skyline.quant.method import LinearLayer, keeps_bf16_copy, room_for

INT4_GROUP = 32  # elements per scale/offset of the 4-bit group types
# Planes of the CPU int4 kernel a layer may take: 2 runs 5- to 8-bit codes as two (10 bits a
# weight, faster than dense bf16 for one or two rows but about half its speed at eight: the
# kernel is compute-bound there); 1 keeps those types dense bfloat16 (16 bits).
MAX_CPU_PLANES = envs.ENV.gguf_cpu_planes


@dataclass
class PackedGGUF:
    """One GGUF tensor as stored: rows of whole blocks."""

    data: torch.Tensor  # [rows, bytes_per_row] uint8
    qtype: int  # ggml type id
    cols: int  # elements per row once dequantized


class GGUFLinearMethod:
    """Holds each checkpoint tensor's raw blocks; shards of one type are stacked into one
    buffer `gguf_w{i}` (a merged projection of mixed types keeps one buffer per run of a type).
    """

    name = "gguf"

    def create_weights(self, layer: LinearLayer) -> None:
        # An empty placeholder carries the loader; process_weights_after_loading removes it.
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = _loader(layer)  # type: ignore[attr-defined]
        layer.weight.shard_ids = tuple(layer.shards)  # type: ignore[attr-defined]
        layer.gguf_parts = {}

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        device = layer.weight.device
        parts = sorted(((layer.shards[s][0], p) for s, p in layer.gguf_parts.items()),
                       key=lambda t: t[0])
        runs: list[list[PackedGGUF]] = []
        for _, part in parts:
            if runs and runs[-1][0].qtype == part.qtype:
                runs[-1].append(part)
            else:
                runs.append([part])
        layer.gguf_types = []
        for i, run in enumerate(runs):
            data = run[0].data if len(run) == 1 else torch.cat([p.data for p in run])
            layer.register_buffer(f"gguf_w{i}", data.to(device).contiguous())
            layer.gguf_types.append(run[0].qtype)
        del layer.weight
        del layer.gguf_parts

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if getattr(layer, "cpu_dense", None) is not None:
            dense = layer.cpu_dense
            return (cpu_linear.unpack(dense) if dense.is_mkldnn else dense).float()
        if getattr(layer, "cpu_planes", None) is not None:
            return cpu_int4.planes_weight(layer.cpu_planes)
        if getattr(layer, "cpu_intdot", None) is not None:
            return cpu_intdot.dequantize(layer.cpu_intdot)
        if (w := cuda_weight(layer)) is not None:
            return w
        if getattr(layer, "gguf_int4", None) is not None:
            return cpu_int4.planes_weight(layer.gguf_int4)
        if hasattr(layer, "gguf_dense"):
            return layer.gguf_dense.float()
        return dequantize_blocks(layer)

    def prepack_cpu(self, layer: LinearLayer, dtype: torch.dtype) -> bool:
        """The layout a CPU engine serves with (loader.prepack_for_cpu; tools that read or save
        weights never call it), by this machine's plan (ops/cpu_plan.py): the int4 kernel's
        planes for decode-sized batches where the plan runs this layer's codes on it, and the
        weights dequantized once to `dtype` (oneDNN-packed) for larger batches; the raw blocks
        are dropped. From then on every input takes one of the two."""
        if not getattr(layer, "gguf_types", None):  # no blocks (a model built on meta)
            return False
        cpu = cpu_plan.plan()
        types = [int(t) for t in layer.gguf_types]
        four_bit = all(t in INT4_GROUP_TYPES for t in types)
        # the integer dot kernel's rows for these codes (the plan's int4_kernel for 4-bit ones)
        intdot_rows = ((cpu.int4_rows if cpu.int4_kernel == "intdot" else 0) if four_bit
                       else cpu.intdot_rows)
        layer.cpu_intdot = _pack_intdot(layer, cpu.intdot_rounds) if intdot_rows else None
        if layer.cpu_intdot is not None:
            rows, layer.cpu_planes = intdot_rows, None
        else:
            rows = cpu.int4_rows if four_bit else cpu.int4_wide_rows
            layer.cpu_planes = _pack_int4(layer) if rows else None
        # batches of at most this many rows run the planes or the integer dot kernel
        layer.cpu_plane_rows = rows if (layer.cpu_planes, layer.cpu_intdot) != (None, None) else 0
        # the planes' group where a bfloat16 x [M, in_features] goes straight to planes_mm
        # (one plane, no padding columns, no bias), else 0
        layer.cpu_plane_group = 0
        if layer.cpu_planes is not None and len(layer.cpu_planes) == 1 and layer.bias is None:
            if cpu_int4.planes_cols(layer.cpu_planes) == layer.in_features:
                layer.cpu_plane_group = cpu_int4.planes_group(layer.cpu_planes)
        layer.cpu_dense = layer.cpu_bf16 = None
        dense_bytes = layer.out_features * layer.in_features * dtype.itemsize
        if not layer.cpu_plane_rows or room_for(dense_bytes):
            dense = dequantize_blocks(layer).to(dtype)
            layer.cpu_dense = cpu_linear.pack(dense) if cpu_linear.can_pack(dense) else dense
            # codes no kernel above takes (16-bit ones): few rows on the bf16 kernel, on the
            # plain weight kept beside the packed one where that fits, or on the plain weight
            # alone where oneDNN packs no bfloat16 (AVX2)
            if not layer.cpu_plane_rows and (
                    keeps_bf16_copy(dense, cpu.bf16_rows) if layer.cpu_dense.is_mkldnn
                    else (dense.dtype == torch.bfloat16 and cpu.bf16_rows > 0
                          and cpu_bf16.available())):
                layer.cpu_bf16, layer.cpu_plane_rows = dense, cpu.bf16_rows
        else:  # every batch on the planes: slower prefill, but it fits
            layer.cpu_plane_rows = cpu_ext.ANY_ROWS
        for i in range(len(layer.gguf_types)):
            delattr(layer, f"gguf_w{i}")
        return True

    def decode_bytes(self, layer: LinearLayer) -> int | None:
        """Bytes a one-row product reads where it is less than the layer holds: the int4
        planes, integer dot codes or bf16 kernel's plain weight of a CPU engine's layer
        (prepack_cpu), not its dense copy; None otherwise."""
        planes = getattr(layer, "cpu_planes", None)
        if getattr(layer, "cpu_plane_rows", 0) < 1:
            return None
        if layer.cpu_bf16 is not None:
            return layer.cpu_bf16.numel() * layer.cpu_bf16.element_size()
        if layer.cpu_intdot is not None:
            return layer.cpu_intdot.nbytes()
        return sum(t.numel() * t.element_size() for p in planes for t in p)

    def cpu_decode_product(self, layer: LinearLayer) -> tuple[
            Callable[[torch.Tensor], torch.Tensor], int, cpu_ext.NativeProduct] | None:
        """(product, rows, native): what `apply` computes for a bfloat16 or float32 x
        [M, in_features] of at most `rows` rows, with no check on the way (a CPU engine's layer
        whose int4 planes take such an x as it is: prepack_cpu's cpu_plane_group, or whose
        integer dot kernel takes it), and the same product for the C++ decode step; None
        otherwise."""
        if getattr(layer, "cpu_intdot", None) is not None and layer.bias is None:
            w = layer.cpu_intdot

            def intdot(x: torch.Tensor) -> torch.Tensor:
                return cpu_intdot.intdot_mm(x.contiguous(), w)

            native = cpu_ext.NativeProduct(cpu_ext.INTDOT, (w.codes, w.scale, w.offset),
                                           w.bits, w.group, w.rounds, layer.cpu_plane_rows,
                                           layer.cpu_dense)
            return intdot, layer.cpu_plane_rows, native
        if getattr(layer, "cpu_bf16", None) is not None and layer.bias is None:
            native = cpu_ext.NativeProduct(cpu_ext.BF16, (layer.cpu_bf16,), 0, 0, 0,
                                           layer.cpu_plane_rows, layer.cpu_dense)
            return (lambda x: _serve_cpu(layer, x)), cpu_ext.ANY_ROWS, native
        group = getattr(layer, "cpu_plane_group", 0)
        if not group:
            return None

        def product(x: torch.Tensor) -> torch.Tensor:
            if x.dtype == torch.bfloat16:
                return cpu_int4.planes_mm(x, layer.cpu_planes, group)
            # through bfloat16, as planes_linear
            return cpu_int4.planes_mm(x.to(torch.bfloat16), layer.cpu_planes, group).to(x.dtype)

        native = cpu_ext.NativeProduct(cpu_ext.INT4_PLANE, tuple(layer.cpu_planes[0]), group, 0,
                                       0, layer.cpu_plane_rows, layer.cpu_dense)
        return product, layer.cpu_plane_rows, native

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        if hasattr(layer, "cpu_plane_rows"):
            return _serve_cpu(layer, x)
        if x.is_cuda and _cuda_ready(layer, x.dtype):
            return _int_apply(layer, x)
        if x.device.type == "cpu" and _cpu_ready(layer, build=x.dtype == torch.bfloat16):
            if layer.gguf_int4 is None:
                return F.linear(x, layer.gguf_dense.to(x.dtype), layer.bias)
            return cpu_int4.planes_linear(x, layer.gguf_int4, layer.bias)
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype), layer.bias)


def _serve_cpu(layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
    """A CPU engine's product (prepack_cpu's layout): few rows on the int4, integer dot or bf16
    kernel (a bf16 one takes bfloat16 rows only), more on the dense weights."""
    if x.numel() <= layer.cpu_plane_rows * layer.in_features:
        if layer.cpu_bf16 is not None:
            if x.dtype == torch.bfloat16:
                return cpu_bf16.bf16_linear(x, layer.cpu_bf16, layer.bias)
        elif layer.cpu_intdot is not None:
            return cpu_intdot.intdot_linear(x, layer.cpu_intdot, layer.bias)
        else:
            return cpu_int4.planes_linear(x, layer.cpu_planes, layer.bias)
    dense = layer.cpu_dense
    if dense.is_mkldnn:
        return cpu_linear.packed_linear(x, dense, layer.bias)
    return cpu_bf16.dense_linear(x, dense, layer.bias)


def _cpu_ready(layer: LinearLayer, build: bool) -> bool:
    """Whether the layer has its CPU bfloat16 form: the int4 kernel's packed weights
    (`gguf_int4`) or, for other block types, dense bfloat16 weights (`gguf_dense`). With
    `build` (a bfloat16 input), the first call makes it and drops the raw blocks."""
    if not hasattr(layer, "gguf_int4"):
        if not build:
            return False
        layer.gguf_int4 = _pack_int4(layer) if cpu_int4.has_kernel() else None
        if layer.gguf_int4 is None:
            layer.register_buffer("gguf_dense", dequantize_blocks(layer).to(torch.bfloat16))
        for i in range(len(layer.gguf_types)):
            delattr(layer, f"gguf_w{i}")
    return True


def _pack_int4(layer: LinearLayer) -> tuple[cpu_int4.Plane, ...] | None:
    """The layer's weights as planes of torch's CPU int4 kernel (ops/cpu_int4.py): one when
    every run is a 4-bit group type, two when a run has wider codes; None unless every run has
    an affine map per 32 elements (and the kernel takes the shape)."""
    types = [int(t) for t in layer.gguf_types]
    if not all(AFFINE_GROUP.get(t) == INT4_GROUP for t in types):
        return None
    wide = not all(t in INT4_GROUP_TYPES for t in types)
    if wide and MAX_CPU_PLANES < 2:
        return None
    parts = [affine_groups(getattr(layer, f"gguf_w{i}"), t)[:3] for i, t in enumerate(types)]
    codes, scale, offset = (torch.cat(c) for c in zip(*parts, strict=True))
    return cpu_int4.pack_planes(codes, scale, offset, INT4_GROUP, wide)


def _pack_intdot(layer: LinearLayer, rounds: int) -> cpu_intdot.IntDotWeight | None:
    """The layer's weights in the integer dot kernel's layout (pack_intdot)."""
    runs = [(getattr(layer, f"gguf_w{i}"), int(t)) for i, t in enumerate(layer.gguf_types)]
    return pack_intdot(runs, layer.in_features, rounds)


def pack_intdot(runs: list[tuple[torch.Tensor, int]], in_features: int, rounds: int
                ) -> cpu_intdot.IntDotWeight | None:
    """Runs of raw blocks (data [rows, bytes], ggml type), stacked by rows, in the integer dot
    kernel's layout (ops/cpu_intdot.py), for activations rounded `rounds` times: the file's
    codes with a scale and offset per 16 elements where a run has 16-element groups (Q6_K,
    Q2_K, Q3_K; the other runs' scales repeated), else per 32; where every run is a K type, the
    scales as the file holds them (an integer per group, a factor per 256 elements: ~0.6 bits a
    weight, not 1 or 2), else float16 per group. None unless every run has integer codes with
    an affine map per group, the rows are whole blocks, or where the kernel is not built."""
    if not cpu_intdot.available() or not all(t in AFFINE_GROUP for _, t in runs):
        return None
    w = None
    if all(int(t) in SUPER_GROUP_TYPES for _, t in runs):
        supers = (super_groups(data, t) for data, t in runs)
        codes, sub_scale, scale_d, sub_offset, offset_d, groups = zip(*supers, strict=True)
        group = min(groups)
        w = cpu_intdot.pack_super(torch.cat(codes), _repeated(sub_scale, groups, group),
                                  torch.cat(scale_d), _repeated(sub_offset, groups, group),
                                  torch.cat(offset_d), group, rounds)
    if w is None:  # float16 per group
        codes, scale, offset, groups = zip(*(affine_groups(d, t) for d, t in runs), strict=True)
        group = min(groups)
        w = cpu_intdot.pack(torch.cat(codes), _repeated(scale, groups, group),
                            _repeated(offset, groups, group), group, rounds)
    return w if w is not None and w.shape[1] == in_features else None


def _repeated(values: tuple[torch.Tensor, ...], groups: tuple[int, ...], group: int
              ) -> torch.Tensor:
    """Per-group values of runs with groups of `groups` elements, stacked by rows, each
    repeated to one per `group` elements."""
    return torch.cat([v.repeat_interleave(g // group, dim=1)
                      for v, g in zip(values, groups, strict=True)])


def _rank_slice(layer: LinearLayer, loaded: PackedGGUF, shard_id: Any,
                rows: int) -> PackedGGUF:
    """This rank's part of a tensor's blocks: its rows (column-parallel) or whole blocks of
    its input columns (row-parallel)."""
    if layer.tp_cols is None:
        data = layer.take_shard(loaded.data, shard_id, torch.Size((rows, loaded.data.shape[1])))
        return PackedGGUF(data, loaded.qtype, loaded.cols)
    start, cols, _ = layer.tp_cols
    name, block, size = GGML_TYPES[loaded.qtype]
    if start % block or cols % block:
        raise ConfigError(
            f"GGUF {name} blocks of {block} cannot be split at input column "
            f"{start} ({cols} columns a rank); use another --tensor-parallel-size or load "
            "without --quantization gguf")
    held = torch.Size((rows, cols // block * size))
    return PackedGGUF(layer.take_shard(loaded.data, shard_id, held).contiguous(), loaded.qtype,
                      cols)


def _loader(layer: LinearLayer) -> Any:
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if not isinstance(loaded, PackedGGUF):
            raise ConfigError("--quantization gguf needs a .gguf model; use another method")
        if shard_id not in layer.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {list(layer.shards)}")
        rows = layer.shards[shard_id][1]
        loaded = _rank_slice(layer, loaded, shard_id, rows)
        if loaded.data.shape[0] != rows or loaded.cols != layer.in_features:
            raise ConfigError(
                f"shape ({loaded.data.shape[0]}, {loaded.cols}) does not match the model's "
                f"({rows}, {layer.in_features}); does the GGUF metadata fit its tensors?"
            )
        layer.gguf_parts[shard_id] = loaded

    return load
