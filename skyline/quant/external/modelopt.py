"""NVIDIA ModelOpt checkpoints (`quant_method` "modelopt" in config.json, or an
hf_quant_config.json beside it) onto skyline's formats:

- quant_algo "FP8": `weight` e4m3 [N, K] with `weight_scale` [] (per tensor) and a static
  per-tensor `input_scale` [] -> fp8 with static activations; "FP8_PER_CHANNEL_PER_TOKEN":
  `weight_scale` [N] and activations quantized per token -> fp8.
- quant_algo "NVFP4": `weight` uint8 [N, K / 2] (E2M1, element 2j in the low nibble),
  `weight_scale` e4m3 [N, K / 16], `weight_scale_2` [] (w = e2m1 * weight_scale *
  weight_scale_2: skyline's NVFP4 exactly) -> nvfp4; `input_scale` is for FP4 activations,
  which need FP4 units: activations stay in the model dtype (W4A16).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from skyline.config import CheckpointLayout, QuantConfig

ALGOS = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8", "NVFP4": "nvfp4"}


def parse(q: dict[str, Any], refuse: Any) -> tuple[str, int, CheckpointLayout]:
    algo = q.get("quant_algo")
    if algo not in ALGOS:
        refuse(f"ModelOpt's {algo!r} algorithm (only {', '.join(ALGOS)})")
    return ALGOS[algo], 128, CheckpointLayout("modelopt", static_input=algo == "FP8")


def translate(weights: Iterable[tuple[str, torch.Tensor]], cfg: QuantConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    nvfp4 = cfg.method == "nvfp4"
    for name, t in weights:
        prefix, _, kind = name.rpartition(".")
        if not nvfp4:
            yield name, t
        elif kind == "weight" and t.dtype == torch.uint8:
            yield f"{prefix}.qweight", t
        elif kind == "weight_scale":
            yield f"{prefix}.scales", t
        elif kind == "weight_scale_2":
            yield f"{prefix}.tensor_scale", t
        elif kind != "input_scale":
            yield name, t
