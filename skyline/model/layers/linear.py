"""Linear layers that own their weights and know how to load them from HF checkpoints.

A merged projection (q/k/v, gate/up) is one matmul over a weight stacked along the output
dim; the checkpoint stores the parts separately, so `weight_loader(param, loaded, shard_id)`
copies each part into its slice. Quantization plugs in through `LinearMethod`
(quant/method.py): it creates the layer's parameters and applies the matmul; model files never
change.

Tensor parallelism is the layer's too (`shard`, called before the weights exist): a
column-parallel layer holds some output rows of each part (q/k/v by head, gate/up evenly), a
row-parallel one some input columns, its partial products summed over its tensor-parallel
group; each loads only its slice of a checkpoint tensor. Quantized weights are quantized row
by row, so a column slice of a layer is a row slice of every tensor of its format; a row slice
must cut whole groups of a group-quantized format (`column_block`). Quantized at load (not
from a quantized checkpoint), a row slice takes its own fp8 row scales or nvfp4 tensor scale:
as fine as one process's, not equal to them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from skyline import envs
from skyline.config import ConfigError
from skyline.parallel.groups import Group, ParallelLayout
from skyline.parallel.shard import even_shard, head_shard
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
    the single shard None covering everything. `parallel`: None (every rank holds the whole
    layer), "column" (each rank some output rows) or "row" (each rank some input columns;
    the outputs are summed over the tensor-parallel group).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shards: dict[Any, tuple[int, int]] | None = None,
        linear_method: LinearMethod | None = None,
        parallel: str | None = None,
    ) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', got {parallel!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.shards = shards or {None: (0, out_features)}
        self.parallel = parallel
        # Set by `shard` when the layer is split: the checkpoint rows of each shard this rank
        # holds (column), or its input columns (start, size, of total) (row).
        self.tp_rows: dict[Any, tuple[int, int]] | None = None
        self.tp_cols: tuple[int, int, int] | None = None
        self.tp_index = 0
        self.reduce_group: Group | None = None  # row-parallel: sums the partial products
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self)
        self.bias: nn.Parameter | None = None
        if bias:
            self._make_bias()

    def _make_bias(self) -> None:
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
        set_loader(self.bias, self, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy checkpoint tensor `loaded` (any device/dtype) into shard `shard_id` of `param`
        (this rank's slice of it, if the layer is split)."""
        if shard_id not in self.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {list(self.shards)}")
        offset, size = self.shards[shard_id]
        dst = param.data.narrow(0, offset, size)
        loaded = self.take_shard(loaded, shard_id, dst.shape, param is self.bias)
        if dst.shape != loaded.shape:
            raise ConfigError(shape_error(loaded.shape, dst.shape))
        dst.copy_(loaded)

    def take_shard(self, loaded: torch.Tensor, shard_id: Any, local: torch.Size,
                   is_bias: bool = False) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `loaded` (shard `shard_id`) for a parameter
        slice of shape `local`: rows of a column-parallel layer; columns of a row-parallel one,
        in proportion to its input columns (a packed format holds fewer per element), its bias
        on the first rank only (the partial products are summed) and per-row tensors whole."""
        if self.tp_rows is not None:
            start, rows = self.tp_rows[shard_id]
            if start + rows > loaded.shape[0]:
                raise ConfigError(shape_error(loaded.shape, local))
            return loaded.narrow(0, start, rows)
        if self.tp_cols is None or loaded.dim() < 2:
            if is_bias and self.tp_cols is not None and self.tp_index:
                return torch.zeros_like(loaded)
            return loaded
        start, cols, total = self.tp_cols
        held = local[1]  # this rank's columns of the parameter: `cols` inputs
        if loaded.shape[1] * cols != held * total or (start * held) % cols:
            raise ConfigError(shape_error(loaded.shape, local))
        return loaded.narrow(1, start * held // cols, held)

    def checkpoint_shape(self, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
        """The shape of the checkpoint tensor that fills shard `shard_id` of `param` (the
        unquantized weight, or the bias), whatever part of it this rank holds."""
        rows = self.full_rows[shard_id] if self.tp_rows is not None else \
            self.shards[shard_id][1]
        if param is self.bias:
            return (rows,)
        return (rows, self.tp_cols[2] if self.tp_cols is not None else self.in_features)

    def shard(self, layout: ParallelLayout) -> None:
        """Keep this rank's part of the layer (before its weights are made or loaded)."""
        tp = layout.tp
        if self.parallel is None or tp.size == 1:
            return
        self.tp_index = tp.index
        if self.parallel == "column":
            self._shard_rows({sid: even_shard(size, tp.size, tp.index, "output size")
                              for sid, (_, size) in self.shards.items()})
        else:
            start, size = even_shard(self.in_features, tp.size, tp.index, "input size")
            self._shard_cols(start, size, tp)

    def _shard_rows(self, rows: dict[Any, tuple[int, int]]) -> None:
        """Hold checkpoint rows `rows[shard id]` = (start, count) of each shard."""
        self.full_rows = {sid: size for sid, (_, size) in self.shards.items()}
        self.tp_rows = rows
        self.shards, offset = {}, 0
        for sid, (_, n) in rows.items():
            self.shards[sid] = (offset, n)
            offset += n
        self.out_features = offset
        self._remake()

    def _shard_cols(self, start: int, size: int, tp: Group) -> None:
        self.tp_cols = (start, size, self.in_features)
        self.in_features = size
        self.reduce_group = tp
        self._remake()

    def _remake(self) -> None:
        """Make the parameters again at the layer's new size."""
        self.set_linear_method(self.linear_method)
        if self.bias is not None:
            self._make_bias()

    def set_linear_method(self, linear_method: LinearMethod) -> None:
        """Replace the weight layout before loading (quant/ does this; model files never do).
        Call under the same default device and dtype as the model's construction."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        self.linear_method = linear_method
        linear_method.create_weights(self)
        block = getattr(linear_method, "column_block", 1)
        if self.tp_cols is not None and (self.tp_cols[0] % block or self.in_features % block):
            raise ConfigError(
                f"a {linear_method.name} layer in groups of {block} cannot be split at input "
                f"column {self.tp_cols[0]} ({self.in_features} of {self.tp_cols[2]} columns a "
                "rank); use a smaller --quant-group-size or another --tensor-parallel-size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x may also come quantized (ops/fp8_quant.Fp8Rows, ops/gemv_int_a8.Int8Chunks)
        y = self.linear_method.apply(self, x)
        if self.reduce_group is not None:
            y = self.reduce_group.all_reduce(y)
        return y

    def input_quant(self, x: torch.Tensor) -> str | None:
        """How the kernel about to make x (a norm, an activation) should hand it over: "fp8",
        quantized per row (ops/fp8_quant.Fp8Rows), for an fp8 layer's decode GEMV or
        torch._scaled_mm on a GPU with fp8 units; "int8", rounded per 32 columns
        (ops/gemv_int_a8.Int8Chunks), for an INT4 layer's W4A8 decode GEMV; None as it is. The
        product then skips quantizing it. Always None under SKYLINE_UNFUSE=act_quant (the
        modular form, to measure the fusion: the product quantizes its input itself)."""
        if "act_quant" in envs.ENV.unfuse:
            return None
        wants = getattr(self.linear_method, "input_quant", None)
        return wants(self, x) if wants is not None else None

    def cpu_decode_product(self) -> tuple[Any, int, Any] | None:
        """(product, rows, native): a function computing this layer for a bfloat16 or float32 x
        [M, in_features] of at most `rows` rows with no check on the way, and the same product
        for the C++ decode step (ops/cpu_ext.NativeProduct), where its method has one (a CPU
        engine's oneDNN-packed weights, bf16 kernel, int4 planes or integer dot codes) and no
        collective follows; None otherwise."""
        get = getattr(self.linear_method, "cpu_decode_product", None)
        return get(self) if get is not None and self.reduce_group is None else None

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
        super().__init__(hidden_size, q_size + 2 * kv_size, bias, shards, linear_method,
                         parallel="column")
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.output_sizes = [q_size, kv_size, kv_size]

    def shard(self, layout: ParallelLayout) -> None:
        """Keep the query heads and the KV heads this rank's attention reads (shard.py)."""
        if layout.tp.size == 1:
            return
        h = head_shard(self.num_heads, self.num_kv_heads, layout.tp.size, layout.tp.index)
        d = self.head_dim
        self._shard_rows({"q": (h.q_start * d, h.num_q * d), "k": (h.kv_start * d, h.num_kv * d),
                          "v": (h.kv_start * d, h.num_kv * d)})
        self.output_sizes = [h.num_q * d, h.num_kv * d, h.num_kv * d]


class AttentionOutLinear(Linear):
    """The output projection of attention heads: [T, num_heads * head_dim] -> [T, hidden].
    Row-parallel over the query heads this rank's QKVLinear holds."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int,
                 bias: bool = False) -> None:
        super().__init__(num_heads * head_dim, hidden_size, bias, parallel="row")
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads

    def shard(self, layout: ParallelLayout) -> None:
        if layout.tp.size == 1:
            return
        self.tp_index = layout.tp.index
        h = head_shard(self.num_heads, self.num_kv_heads, layout.tp.size, layout.tp.index)
        self._shard_cols(h.q_start * self.head_dim, h.num_q * self.head_dim, layout.tp)


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
        super().__init__(in_features, sum(output_sizes), bias, shards, linear_method,
                         parallel="column")
        self.output_sizes = list(output_sizes)

    def shard(self, layout: ParallelLayout) -> None:
        super().shard(layout)
        self.output_sizes = [size for _, size in self.shards.values()]
