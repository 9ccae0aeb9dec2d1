"""The shared shape of a quantized Linear: weights quantized row by row (one output row never
mixes with another), so a merged projection's shards stay row slices of every tensor.

A `QuantLinearMethod` either loads full-precision weights and quantizes them once loading is
done (online), or creates the quantized tensors and loads them from a checkpoint written by
`skyline quantize` (prequantized). Both end with the same parameters, so a saved checkpoint
reloads bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError, QuantConfig
from skyline.ops import cpu_linear
from skyline.ops.fp4 import pack_nibbles, unpack_nibbles
from skyline.ops.gemv_quant import int_gemv, quant_gemv_ok
from skyline.ops.int_matmul import int_matmul_ref, int_matmul_triton
from skyline.quant.method import LinearLayer, set_loader, shape_error

__all__ = ["pack_nibbles", "unpack_nibbles"]  # the formats' shared packing (ops/fp4.py)


def pad_cols(w: torch.Tensor, multiple: int) -> torch.Tensor:
    """[rows, cols] -> [rows, ceil(cols / multiple) * multiple], zero-padded on the right."""
    pad = -w.shape[-1] % multiple
    return F.pad(w, (0, pad)) if pad else w


def int_codes_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, bits: int, group: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] through W = (q - zero) * scale in ops/int_matmul.py's layout: the quantized
    GEMV for decode-sized batches on CUDA (codes unpacked in registers), the dequant-matmul
    kernel above that, the reference elsewhere."""
    if quant_gemv_ok(x):
        return int_gemv(x, qweight, scales, zeros, bits, group, bias=bias)
    args = (x, qweight, scales, zeros, bits, group)
    y = int_matmul_triton(*args) if x.is_cuda else int_matmul_ref(*args)
    return y if bias is None else y + bias


def keep_dense(layer: LinearLayer, w: torch.Tensor, drop: tuple[str, ...]) -> None:
    """A CPU serving layout for formats no CPU kernel takes: the weight w [out, in],
    dequantized once (in the engine's dtype), packed for oneDNN where it can be, replaces the
    quantized tensors `drop`."""
    layer.dense_weight = cpu_linear.pack(w) if cpu_linear.can_pack(w) else w
    for name in drop:
        delattr(layer, name)


def dense_weight(layer: LinearLayer) -> torch.Tensor:
    """keep_dense's weight as float32 [out, in]."""
    w = layer.dense_weight
    return (cpu_linear.unpack(w) if w.is_mkldnn else w).float()


def dense_linear(layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype, through keep_dense's weight (its dtype)."""
    w = layer.dense_weight
    if w.is_mkldnn:
        return cpu_linear.packed_linear(x.to(w.dtype), w, layer.bias).to(x.dtype)
    return F.linear(x.to(w.dtype), w, layer.bias).to(x.dtype)


class QuantLinearMethod:
    """Base of the weight formats; subclasses define `param_specs`, `quantize`, `dequantize`."""

    name = ""
    # Parameters holding one value per checkpoint tensor (stored per row in a merged layer).
    per_tensor: tuple[str, ...] = ()
    # Input columns that share a scale: a row-parallel split must cut between such groups.
    column_block = 1
    # Parameters a checkpoint of another tool may store coarser than per row
    # (shard_rows_loader): per tensor, per channel of a group-wise layout, per block of rows.
    coarse: tuple[str, ...] = ()

    def __init__(self, cfg: QuantConfig) -> None:
        self.group_size = cfg.group_size
        self.prequantized = cfg.prequantized
        self.layout = cfg.layout  # a checkpoint of another tool (quant/external/)

    # -- format: subclasses -------------------------------------------------------------------

    def param_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the quantized tensors of a [rows, cols] weight."""
        raise NotImplementedError

    def quantize(
        self, w: torch.Tensor, act_sq: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Quantize one checkpoint tensor w [rows, cols]; `act_sq` [cols] is the mean squared
        input activation per channel from calibration (None: plain round-to-nearest)."""
        raise NotImplementedError

    def dequantize(self, q: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        """The float32 weight [rows, cols] the quantized tensors stand for (the reference)."""
        raise NotImplementedError

    # -- the LinearMethod interface -----------------------------------------------------------

    def create_weights(self, layer: LinearLayer) -> None:
        if not self.prequantized:  # load full precision; process_weights_after_loading quantizes
            weight = torch.empty(layer.out_features, layer.in_features)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            set_loader(layer.weight, layer, layer.weight_loader)
            return
        specs = {**self.param_specs(layer.out_features, layer.in_features),
                 **self.load_specs(layer)}
        for name, (shape, dtype) in specs.items():
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            setattr(layer, name, param)
            set_loader(param, layer, self.loader(layer, name))

    def load_specs(self, layer: LinearLayer) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Tensors a checkpoint of another tool carries beside param_specs' (g_idx, static
        input scales), consumed by finish_prequantized."""
        return {}

    def loader(self, layer: LinearLayer, name: str) -> Any:
        """The weight loader of parameter `name`."""
        if self.layout is not None and name in self.coarse + self.per_tensor:
            return shard_rows_loader(layer, self.block_rows())
        return _per_tensor_loader(layer) if name in self.per_tensor else layer.weight_loader

    def block_rows(self) -> int:
        """Rows of one of the layout's scale blocks (1: scales per row)."""
        return 1

    def finish_prequantized(self, layer: LinearLayer) -> None:
        """Once a prequantized layer is loaded: bring what load_specs loaded into the serving
        layout."""

    def process_weights_after_loading(self, layer: LinearLayer) -> None:
        """Online: quantize each checkpoint tensor (shard) of the loaded weight, then drop it."""
        if self.prequantized:
            self.finish_prequantized(layer)
            return
        w = layer.weight.data
        tensors = self.quantize_shards(w, layer.shards, getattr(layer, "act_sq", None))
        del layer.weight
        self.set_tensors(layer, {name: t.to(w.device) for name, t in tensors.items()})

    def quantize_shards(
        self, w: torch.Tensor, shards: dict[Any, tuple[int, int]],
        act_sq: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The layer's tensors (as `param_specs`) for its full-precision weight w [rows, cols]:
        each checkpoint tensor (shard) quantized on its own, per-tensor values repeated per
        row."""
        parts = [self.quantize(w.narrow(0, off, size).float(), act_sq)
                 for off, size in shards.values()]
        out = {}
        for name in parts[0]:
            rows = [p[name].expand(size, *p[name].shape[1:]) if name in self.per_tensor else p[name]
                    for p, (_, size) in zip(parts, shards.values(), strict=True)]
            out[name] = torch.cat(rows).contiguous()
        return out

    def set_tensors(self, layer: LinearLayer, tensors: dict[str, torch.Tensor]) -> None:
        """Install quantized tensors (from `quantize_shards`) as the layer's parameters."""
        for name, tensor in tensors.items():
            setattr(layer, name, nn.Parameter(tensor, requires_grad=False))

    def tensors(self, layer: LinearLayer) -> dict[str, torch.Tensor]:
        specs = self.param_specs(layer.out_features, layer.in_features)
        return {name: getattr(layer, name) for name in specs}

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        return self.dequantize(self.tensors(layer), layer.in_features)

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        # Reference path: dequantize the whole weight, then one matmul in x's dtype.
        w = self.dequantized_weight(layer).to(x.dtype)
        return F.linear(x, w, layer.bias)


def shard_rows_loader(layer: LinearLayer, block_rows: int = 1) -> Any:
    """A loader for a parameter of one value per row ([rows]) or per row and column group
    ([rows, groups]) that also takes what other tools store for one shard of `size` rows: one
    value ([] or [1]), one per row ([size] or [size, 1], repeated along the groups: per-channel
    scales in a group-wise layout), or one per `block_rows` rows ([cdiv(size, block_rows),
    groups]: fp8 block scales)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id not in layer.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {list(layer.shards)}")
        offset, size = layer.shards[shard_id]
        dst = param.data.narrow(0, offset, size)
        src = loaded.reshape(1) if loaded.numel() == 1 else loaded
        if src.dim() == 1 and src.numel() > 1:
            src = src.reshape(-1, 1)
        if block_rows > 1 and src.shape[0] == -(-size // block_rows) and src.numel() > 1:
            src = src.repeat_interleave(block_rows, dim=0)[:size]
        if dst.dim() == 1 and src.dim() == 2 and src.shape[1] == 1:
            src = src[:, 0]
        try:
            dst.copy_(src.expand_as(dst))
        except RuntimeError:
            raise ConfigError(shape_error(loaded.shape, dst.shape)) from None

    return load


def _per_tensor_loader(layer: LinearLayer) -> Any:
    """A loader that writes one checkpoint scalar into every row of its shard."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id not in layer.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {list(layer.shards)}")
        if loaded.numel() != 1:
            raise ConfigError(shape_error(loaded.shape, torch.Size([1])))
        offset, size = layer.shards[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.reshape(1).expand(size))

    return load
