"""GGUF weights kept packed: a Linear holds the file's raw blocks (Q4_1, Q6_K, ... as stored)
and dequantizes them with ops/dequant.py at every forward, so the model takes about as much
memory as the file, as in llama.cpp. A Triton dequant-matmul that reads the blocks inside the
matmul is the next step; today the CPU pays a full dequantization per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.model.layers.linear import Linear
from skyline.ops.dequant import dequantize_ref


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

    def create_weights(self, layer: Linear) -> None:
        # An empty placeholder carries the loader; process_weights_after_loading removes it.
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = _loader(layer)  # type: ignore[attr-defined]
        layer.weight.shard_ids = tuple(layer.shards)  # type: ignore[attr-defined]
        layer.gguf_parts = {}

    def process_weights_after_loading(self, layer: Linear) -> None:
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

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        ws = [dequantize_ref(getattr(layer, f"gguf_w{i}"), qtype)
              for i, qtype in enumerate(layer.gguf_types)]
        return ws[0] if len(ws) == 1 else torch.cat(ws)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype), layer.bias)


def _loader(layer: Linear) -> Any:
    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if not isinstance(loaded, PackedGGUF):
            raise ConfigError("--quantization gguf needs a .gguf model; use another method")
        if shard_id not in layer.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {list(layer.shards)}")
        rows = layer.shards[shard_id][1]
        if loaded.data.shape[0] != rows or loaded.cols != layer.in_features:
            raise ConfigError(
                f"shape ({loaded.data.shape[0]}, {loaded.cols}) does not match the model's "
                f"({rows}, {layer.in_features}); does the GGUF metadata fit its tensors?"
            )
        layer.gguf_parts[shard_id] = loaded

    return load
