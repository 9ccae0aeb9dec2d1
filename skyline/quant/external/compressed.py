"""compressed-tensors checkpoints (llm-compressor's output; `quant_method`
"compressed-tensors") onto skyline's formats. One weight scheme for every quantized Linear
(config_groups may repeat it); Linears the checkpoint keeps in full precision (`ignore`) are
found from the tensors themselves.

- "float-quantized" / "naive-quantized", 8-bit float weights -> fp8: `weight` e4m3 [N, K],
  `weight_scale` float32 per tensor [1], per channel [N, 1] or per 128 x 128 block
  [N / 128, K / 128]; activations dynamic (per token or per group of 128) or static per tensor
  (`input_scale` [1]).
- "pack-quantized", 4- or 8-bit int weights, no activation quantization -> int4 / int8:
  `weight_packed` int32 [N, K * bits / 32], element 32 / bits * j + i in bits [bits * i,
  bits * (i + 1)) of word j, stored as q + 2^(bits - 1) (q signed); `weight_scale` [N, G]
  (strategy "group") or [N, 1] ("channel"); asymmetric `weight_zero_point` packed the same way
  along the outputs, int32 [N * bits / 32, G] (older versions: int8 [N, G], signed); activation
  order ("group"): `weight_g_idx` [K]; `weight_shape` [2].
- "nvfp4-pack-quantized" -> nvfp4: `weight_packed` uint8 [N, K / 2] (element 2j in the low
  nibble), `weight_scale` e4m3 [N, K / 16] and `weight_global_scale` [1], the reciprocal of
  skyline's tensor scale (w = e2m1 * weight_scale / global_scale). Activations stay in the
  model dtype (W4A16; NVFP4's W4A4 activations need FP4 units).
- "mxfp4-pack-quantized" -> mxfp4: `weight_packed` uint8 [N, K / 2], `weight_scale` E8M0
  uint8 [N, K / 32].
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from skyline.config import CheckpointLayout, QuantConfig
from skyline.quant.external.packing import (
    skyline_codes,
    symmetric_zeros,
    trivial_g_idx,
    unpack_int32,
)

FORMATS = {"float-quantized": "fp8", "naive-quantized": "fp8", "pack-quantized": "int",
           "nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}


def parse(q: dict[str, Any], refuse: Any) -> tuple[str, int, CheckpointLayout]:
    """(skyline format, its group size, layout) of a compressed-tensors quantization_config."""
    if q.get("sparsity_config") or q.get("transform_config"):
        refuse("compressed-tensors with sparsity or transforms")
    groups = list((q.get("config_groups") or {}).values())
    if not groups or not all(isinstance(g, dict) for g in groups):
        refuse("compressed-tensors without config_groups")
    keys = {json.dumps([g.get("weights"), g.get("input_activations"), g.get("format")],
                       sort_keys=True) for g in groups}
    if len(keys) > 1:
        refuse("compressed-tensors with more than one weight scheme")
    scheme = groups[0]
    fmt = scheme.get("format") or q.get("format")
    w, act = scheme.get("weights") or {}, scheme.get("input_activations")
    kind = FORMATS.get(fmt)
    if kind is None:
        refuse(f"compressed-tensors' {fmt!r} format")
    bits, wtype = int(w.get("num_bits", 8)), w.get("type", "int")
    if kind == "fp8":
        return "fp8", 128, _fp8_layout(w, act, bits, wtype, refuse)
    if kind == "int":
        if wtype != "int" or bits not in (4, 8) or act:
            refuse(f"compressed-tensors' {bits}-bit {wtype} weights with "
                   f"{'quantized' if act else 'full-precision'} activations in {fmt}")
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            refuse(f"compressed-tensors' int weights with strategy {strategy!r}")
        group = int(w.get("group_size") or 0) if strategy == "group" else 0
        actorder = w.get("actorder")
        layout = CheckpointLayout("compressed-tensors", bits=bits, group_size=group,
                                  symmetric=bool(w.get("symmetric", True)),
                                  act_order=actorder in (True, "group", "dynamic"))
        return f"int{bits}", group or 128, layout
    if wtype != "float" or bits != 4:
        refuse(f"compressed-tensors' {fmt} with {bits}-bit {wtype} weights")
    return kind, 128, CheckpointLayout("compressed-tensors")


def _fp8_layout(w: dict[str, Any], act: dict[str, Any] | None, bits: int, wtype: str,
                refuse: Any) -> CheckpointLayout:
    if wtype != "float" or bits != 8 or not w.get("symmetric", True):
        refuse(f"compressed-tensors' {bits}-bit {wtype} weights in float-quantized")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        block = tuple(w.get("block_structure") or ())
        if len(block) != 2 or block[1] != 128:
            refuse(f"FP8 weight blocks of {block} (only blocks of 128 columns)")
    elif strategy not in ("tensor", "channel"):
        refuse(f"FP8 weights with strategy {strategy!r}")
    static = bool(act) and not act.get("dynamic")
    if static and act.get("strategy") != "tensor":
        refuse(f"static FP8 activations with strategy {act.get('strategy')!r}")
    return CheckpointLayout("compressed-tensors", bits=8, weight_block=block, static_input=static)


def translate(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    lay = cfg.layout
    assert lay is not None
    for name, t in weights:
        prefix, _, kind = name.rpartition(".")
        if cfg.method in ("int4", "int8"):
            yield from _int_tensor(prefix, kind, name, t, cfg)
        elif cfg.method == "fp8":
            if kind != "input_scale" or lay.static_input:
                yield name, t
        elif kind == "weight_packed":
            yield f"{prefix}.qweight", t
        elif kind == "weight_scale":
            yield f"{prefix}.scales", t
        elif kind == "weight_global_scale":  # nvfp4: skyline multiplies by its reciprocal
            yield f"{prefix}.tensor_scale", 1.0 / t.float()
        elif kind != "input_global_scale":
            yield name, t


def _int_tensor(prefix: str, kind: str, name: str, t: torch.Tensor, cfg: QuantConfig
                ) -> Iterator[tuple[str, torch.Tensor]]:
    lay = cfg.layout
    assert lay is not None
    bits = lay.bits
    if kind == "weight_packed":
        codes = unpack_int32(t, bits, 1)  # [N, K (rounded up to whole words)]
        yield f"{prefix}.qweight", skyline_codes(codes, bits, cfg.group_size)
        if lay.symmetric:
            yield f"{prefix}.zeros", symmetric_zeros(t.shape[0], codes.shape[1], bits,
                                                     cfg.group_size)
    elif kind == "weight_scale":
        yield f"{prefix}.scales", t.float()
    elif kind == "weight_zero_point":
        if t.dtype == torch.int32:  # packed along the outputs
            zeros = unpack_int32(t, bits, 0)
        else:  # signed, unpacked
            zeros = (t.int() + 2 ** (bits - 1)).to(torch.uint8)
        yield f"{prefix}.zeros", zeros
    elif kind == "weight_g_idx":
        if lay.act_order:
            yield f"{prefix}.g_idx", t.to(torch.int32)
        else:
            trivial_g_idx(t, lay.group_size, f"{prefix} (no activation order)")
    elif kind != "weight_shape":
        yield name, t
