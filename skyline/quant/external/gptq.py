"""GPTQ and AWQ checkpoints (AutoGPTQ, GPTQModel, AutoAWQ; W4A16, GPTQ also W8A16) onto
skyline's INT4 / INT8 (quant/intq.py): the same W = (q - zero) * scale per group of input
columns, repacked once while loading.

- GPTQ: `qweight` int32 [K * bits / 32, N], input columns packed, element (32 / bits) * j + i in
  bits [bits * i, bits * (i + 1)) of word j; `qzeros` int32 [G, N * bits / 32] packed the same
  way along the outputs; `scales` float16 [G, N]; `g_idx` int32 [K], every input column's group
  (activation order, `desc_act`: quant/act_order.py). The v1 format (`checkpoint_format`
  "gptq", the default) stores every zero point minus 1, v2 as it is; symmetric checkpoints'
  zero points are 2^(bits - 1) whatever v1 stored. group_size -1: one group per row.
- AWQ (`version` "gemm"): `qweight` int32 [K, N / 8] packed along the outputs, word j holding
  elements 8j + 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7; `qzeros` int32 [G, N / 8] likewise;
  `scales` float16 [G, N]; always asymmetric, never activation-ordered.
"""

from __future__ import annotations

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

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the element in nibble i of an AWQ word


def parse(q: dict[str, Any], refuse: Any) -> tuple[str, int, CheckpointLayout]:
    """(skyline format, its group size, layout) of a GPTQ or AWQ quantization_config."""
    tool = q.get("quant_method")
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if tool == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            refuse(f"AWQ's {version!r} packing (only 'gemm')")
        if bits != 4:
            refuse(f"{bits}-bit AWQ")
        if not q.get("zero_point", True):
            refuse("AWQ without zero points")
        return "int4", group, CheckpointLayout("awq", bits=4, group_size=group, symmetric=False)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        refuse(f"GPTQ's {fmt!r} format (only 'gptq' and 'gptq_v2')")
    if bits not in (4, 8):
        refuse(f"{bits}-bit GPTQ (only 4 and 8 bits)")
    if q.get("dynamic"):
        refuse("GPTQ with per-module settings ('dynamic')")
    if q.get("lm_head"):
        refuse("GPTQ with a quantized LM head")
    per_channel = group <= 0
    layout = CheckpointLayout("gptq", bits=bits, group_size=0 if per_channel else group,
                              symmetric=bool(q.get("sym", True)),
                              zero_offset=1 if fmt == "gptq" else 0,
                              act_order=bool(q.get("desc_act", False)))
    # one group per row: skyline's groups of 128 with the row's scale and zero repeated
    return f"int{bits}", 128 if per_channel else group, layout


def translate(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    lay = cfg.layout
    assert lay is not None
    bits, awq = lay.bits, lay.name == "awq"
    order = AWQ_ORDER if awq else None
    for name, t in weights:
        prefix, _, kind = name.rpartition(".")
        if kind == "qweight":  # -> [N, K] codes
            codes = unpack_int32(t, bits, 1 if awq else 0, order).t()
            yield name, skyline_codes(codes, bits, cfg.group_size)
        elif kind == "qzeros":  # -> [N, G]
            zeros = unpack_int32(t, bits, 1, order).t()
            if not awq:
                zeros = (symmetric_zeros(zeros.shape[0], zeros.shape[1], bits, 1) if lay.symmetric
                         else zeros.int() + lay.zero_offset)
            yield f"{prefix}.zeros", zeros.to(torch.uint8)
        elif kind == "scales":
            yield name, t.t().float()
        elif kind == "g_idx":
            if lay.act_order:
                yield name, t.to(torch.int32)
            else:
                trivial_g_idx(t, lay.group_size, f"{name} (desc_act false)")
        else:
            yield name, t
