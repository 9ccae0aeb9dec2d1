"""Linear layers that own their weights and know how to load them from HF checkpoints.

A merged projection (q/k/v, gate/up) is one matmul over a weight stacked along the output
dim; the checkpoint stores the parts separately, so `weight_loader(param, loaded, shard_id)`
copies each part into its slice. Quantization plugs in through `LinearMethod`
(quant/method.py): it creates the layer's parameters and applies the matmul; model files never
change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from skyline.config import ConfigError
from skyline.quant.method import (
    LinearMethod,
    UnquantizedLinearMethod,
    set_loader,
    shape_error,
)


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
) -> None:
    """Copy a checkpoint tensor whole into a parameter that has no loader of its own."""
    if param.shape != loaded.shape:
        raise ConfigError(shape_error(loaded.shape, param.shape))
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b) over the last dim: [..., in_features] -> [..., out_features].

    `shards` maps a shard id to its (offset, size) along the output dim; a plain Linear has
    the single shard None covering everything.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[Any, tuple[int, int]] | None = None,
        linear_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shards = shards or {None: (0, out_features)}
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_loader(self.bias, self, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy checkpoint tensor `loaded` (any device/dtype) into shard `shard_id` of `param`."""
        if shard_id not in self.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {list(self.shards)}")
        offset, size = self.shards[shard_id]
        dst = param.data.narrow(0, offset, size)
        if dst.shape != loaded.shape:
            raise ConfigError(shape_error(loaded.shape, dst.shape))
        dst.copy_(loaded)

    def set_linear_method(self, linear_method: LinearMethod) -> None:
        """Replace the weight layout before loading (quant/ does this; model files never do).
        Call under the same default device and dtype as the model's construction."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        self.linear_method = linear_method
        linear_method.create_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x may also come quantized (ops/fp8_quant.Fp8Rows, ops/gemv_int_a8.Int8Chunks)
        return self.linear_method.apply(self, x)

    def input_quant(self, x: torch.Tensor) -> str | None:
        """How the kernel about to make x (a norm, an activation) should hand it over: "fp8",
        quantized per row (ops/fp8_quant.Fp8Rows), for an fp8 layer's decode GEMV on a GPU with
        fp8 units; "int8", rounded per 32 columns (ops/gemv_int_a8.Int8Chunks), for an INT4
        layer's W4A8 decode GEMV; None as it is. The GEMV then skips quantizing it."""
        wants = getattr(self.linear_method, "input_quant", None)
        return wants(self, x) if wants is not None else None

    def full_weight(self) -> torch.Tensor | None:
        """The [out, in] weight in the model dtype if the layer is unquantized (dense or
        packed), else None."""
        get = getattr(self.linear_method, "full_weight", None)
        return get(self) if get is not None else None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class QKVLinear(Linear):
    """q, k and v projections as one matmul: [T, hidden] -> [T, (H + 2 * KVH) * head_dim]."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        linear_method: LinearMethod | None = None,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shards = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, shards, linear_method)
        self.output_sizes = [q_size, kv_size, kv_size]


class MergedLinear(Linear):
    """Several projections of one input stacked on the output dim; shard i is output_sizes[i].

    Used for gate/up (shards 0 and 1): [T, hidden] -> [T, 2 * intermediate].
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        linear_method: LinearMethod | None = None,
    ) -> None:
        shards = {i: (sum(output_sizes[:i]), size) for i, size in enumerate(output_sizes)}
        super().__init__(in_features, sum(output_sizes), bias, shards, linear_method)
        self.output_sizes = list(output_sizes)
