"""Activation order (GPTQ's desc_act, compressed-tensors' actorder "group") in INT4/INT8 layers.

Such a checkpoint's g_idx [K] gives every input column its group: the quantizer visited columns
by decreasing activation energy and filled groups in that order, so a group's columns are
scattered. skyline's kernels take groups of contiguous columns, so once at load the input
columns are sorted by group (a stable sort, `perm`): W[:, perm] has contiguous groups with the
checkpoint's scales and zeros as they are, and y = x W^T = x[:, perm] W[:, perm]^T, so the
layer gathers x by `in_perm` before its product (vLLM's Marlin kernels gather the same way).
The projections of a merged layer (q/k/v, gate/up) share x, so their orders must agree (GPTQ
derives the order from the inputs' Hessian, which they share). Where they do not, or a group is
not `group_size` columns, no kernel fits: the layer is dequantized once and served unquantized.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from skyline.config import ConfigError
from skyline.quant.base import pack_nibbles, unpack_nibbles
from skyline.quant.method import LinearLayer, UnquantizedLinearMethod, set_loader, shape_error

log = logging.getLogger(__name__)


def shard_index_loader(layer: LinearLayer) -> Any:
    """A loader writing shard i's g_idx [K] into row i of a [num_shards, K] parameter."""
    order = list(layer.shards)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id not in layer.shards:
            raise ConfigError(f"unknown shard {shard_id!r}; expected one of {order}")
        dst = param.data[order.index(shard_id)]
        if loaded.shape != dst.shape:
            raise ConfigError(shape_error(loaded.shape, dst.shape))
        dst.copy_(loaded)

    return load


def fold_act_order(layer: LinearLayer, bits: int, group: int) -> None:
    """Replace a loaded layer's g_idx [num_shards, K] by its input-column order: codes sorted
    into contiguous groups and `in_perm` [K] (none where the order is the identity), or, where
    no single order fits, the dequantized weight served unquantized (module docstring)."""
    g_idx = layer.g_idx.data.long()
    del layer.g_idx
    k = layer.in_features
    perms = torch.argsort(g_idx, dim=1, stable=True)  # [num_shards, K]
    want = torch.arange(k, device=g_idx.device) // group
    regular = torch.equal(torch.gather(g_idx, 1, perms), want.expand_as(g_idx))
    if regular and bool((perms == perms[0]).all()):
        perm = perms[0]
        if not torch.equal(perm, torch.arange(k, device=perm.device)):
            codes = unpack_nibbles(layer.qweight.data) if bits == 4 else layer.qweight.data
            codes = torch.cat([codes[:, perm], codes[:, k:]], dim=1)
            layer.qweight.data = pack_nibbles(codes) if bits == 4 else codes.contiguous()
            layer.in_perm = perm
        return
    log.warning("a layer's projections order their input columns differently (or in uneven "
                "groups); it is dequantized at load and runs unquantized")
    dense = _dequantize_by_g_idx(layer, g_idx, bits)
    for name in ("qweight", "scales", "zeros"):
        delattr(layer, name)
    layer.weight = nn.Parameter(dense.to(torch.get_default_dtype()), requires_grad=False)
    set_loader(layer.weight, layer, layer.weight_loader)
    layer.linear_method = UnquantizedLinearMethod()


def _dequantize_by_g_idx(layer: LinearLayer, g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """The float32 weight [N, K]: W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = g_idx
    of row n's shard at column k."""
    k = layer.in_features
    codes = (unpack_nibbles(layer.qweight.data) if bits == 4 else layer.qweight.data)[:, :k]
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    for i, (offset, size) in enumerate(layer.shards.values()):
        rows = slice(offset, offset + size)
        g = g_idx[i].expand(size, k)
        zero = torch.gather(layer.zeros.data[rows].float(), 1, g)
        scale = torch.gather(layer.scales.data[rows].float(), 1, g)
        out[rows] = (codes[rows].float() - zero) * scale
    return out


def unpermute(w: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """A weight [N, K] whose columns are in `perm` order back in the checkpoint's order."""
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out
