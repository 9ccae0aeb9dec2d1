"""MXFP4 as gpt-oss ships it (`quant_method` "mxfp4"): a quantized projection P stores
`P_blocks` uint8 [rows, K / 32, 16] (E2M1 codes, element 2j in the low nibble) and `P_scales`
uint8 [rows, K / 32] (E8M0); the rest is unquantized. gpt-oss quantizes only its MoE experts
(`*.experts.gate_up_proj_blocks`, loaded by the expert layers' MXFP4 format); a dense Linear
stored the same way (`<linear>.weight_blocks`, `.weight_scales`) loads onto skyline's MXFP4
Linear, whose layout is those same codes and scales, flattened to [rows, K / 2] as the expert
layers flatten theirs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from skyline.config import CheckpointLayout, QuantConfig


def parse(q: dict[str, Any], refuse: Any) -> tuple[str, int, CheckpointLayout]:
    return "mxfp4", 128, CheckpointLayout("mxfp4")


def translate(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        if name.endswith(".weight_blocks"):
            yield name.removesuffix(".weight_blocks") + ".qweight", t.flatten(1)
        elif name.endswith(".weight_scales"):
            yield name.removesuffix(".weight_scales") + ".scales", t
        else:
            yield name, t
