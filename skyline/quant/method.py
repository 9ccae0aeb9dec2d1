"""The seam between a Linear layer (model/layers/linear.py) and its weight format.

A Linear owns a `LinearMethod`: the method creates the layer's parameters and applies the
matmul; a quantized format (fp8.py, intq.py, fp4.py, gguf.py) supplies its own method and
weight layout, model files never change. This package sits below `model`, so it names the
layer through the `LinearLayer` protocol, never the class.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from skyline.config import ConfigError
from skyline.ops import cpu_bf16, cpu_ext, cpu_linear
from skyline.ops.gemv import gemv_or_linear


@runtime_checkable
class LinearLayer(Protocol):
    """What a method sees of its layer: y = x W^T (+ b), [..., in] -> [..., out]. `shards`
    maps a shard id (q/k/v, gate/up) to its (offset, size) along the output dim."""

    in_features: int
    out_features: int
    shards: dict[Any, tuple[int, int]]
    linear_method: Any
    # tensor parallel: (start, size, total) of the input columns a row-parallel layer holds
    tp_cols: tuple[int, int, int] | None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Any = None) -> None: ...

    def take_shard(self, loaded: torch.Tensor, shard_id: Any, local: torch.Size,
                   is_bias: bool = False) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor, for a parameter slice of shape `local`."""
        ...


class LinearMethod(Protocol):
    """How a Linear stores and applies its weight."""

    def create_weights(self, layer: LinearLayer) -> None: ...

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor: ...


def linears(model: nn.Module) -> dict[str, Any]:
    """Every Linear layer of `model` by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearLayer)}


def iter_linears(model: nn.Module) -> Iterator[Any]:
    return (m for m in model.modules() if isinstance(m, LinearLayer))


class UnquantizedLinearMethod:
    """Weight [out_features, in_features] in the default dtype; y = x W^T + b."""

    def create_weights(self, layer: Any) -> None:
        weight = torch.empty(layer.out_features, layer.in_features)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        set_loader(layer.weight, layer, layer.weight_loader)

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        # F.linear, except a few rows of bf16/fp16 on CUDA (decode) take the Triton GEMV.
        return gemv_or_linear(x, layer.weight, layer.bias)

    def full_weight(self, layer: Any) -> torch.Tensor:
        return layer.weight


class PackedLinearMethod:
    """The unquantized weight packed for oneDNN on the CPU (`ops/cpu_linear.py`): the same
    product as F.linear, faster at decode-sized batches. The layer holds `packed_weight`
    instead of the `weight` Parameter; `prepack` converts a loaded layer. A bfloat16 layer may
    also keep its plain weight (`bf16_weight`) for skyline's bf16 kernel, which batches of at
    most `bf16_rows` bfloat16 rows take (ops/cpu_bf16.py; the CPU plan's bf16_rows). Where
    oneDNN packs no bfloat16 (AVX2) the plain weight is all the layer holds (`packed_weight`
    None): larger batches take float32 GEMMs on it (cpu_bf16.dense_linear)."""

    def create_weights(self, layer: Any) -> None:
        raise ConfigError("a packed Linear is made from a loaded one by prepack(), not loaded")

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        w = getattr(layer, "bf16_weight", None)
        if w is not None and x.dtype == w.dtype and x.numel() <= layer.bf16_rows * w.shape[1]:
            return cpu_bf16.bf16_linear(x, w, layer.bias)
        if layer.packed_weight is None:
            return cpu_bf16.dense_linear(x, w, layer.bias)
        return cpu_linear.packed_linear(x, layer.packed_weight, layer.bias)

    def full_weight(self, layer: Any) -> torch.Tensor:
        if layer.packed_weight is None:
            return layer.bf16_weight
        return cpu_linear.unpack(layer.packed_weight)

    def decode_bytes(self, layer: Any) -> int | None:
        """Bytes a one-row product reads: the bf16 kernel's plain weight where the layer keeps
        one (not also the packed copy); None otherwise (model/cost.py)."""
        w = getattr(layer, "bf16_weight", None)
        return None if w is None else w.numel() * w.element_size()

    def cpu_decode_product(self, layer: Any) -> tuple[Any, int, Any] | None:
        """(product, rows, native) for the CPU decode step (linear.py's cpu_decode_product) of
        a layer without bias: the bf16 kernel's rows where the layer has its weight, else
        oneDNN's packed product for every batch (a float32 model's layers)."""
        w = getattr(layer, "bf16_weight", None)
        if layer.bias is not None or (w is None and layer.packed_weight is None):
            return None
        if w is None:
            native = cpu_ext.NativeProduct(cpu_ext.DENSE, (), 0, rows=0,
                                           dense=layer.packed_weight)
            return (lambda x: self.apply(layer, x)), cpu_ext.ANY_ROWS, native
        dense = w if layer.packed_weight is None else layer.packed_weight
        native = cpu_ext.NativeProduct(cpu_ext.BF16, (w,), 0, 0, 0, layer.bf16_rows, dense)
        return (lambda x: self.apply(layer, x)), cpu_ext.ANY_ROWS, native


# Second copies of weights for a CPU engine's decode kernels (the bf16 kernel's plain weight
# beside oneDNN's packed one, a GGUF layer's dense weight beside its codes) are made while this
# share of the machine's memory stays available after them (the KV cache and the rest of the
# process come later).
MEMORY_RESERVE = 0.25


def room_for(nbytes: int) -> bool:
    """Whether `nbytes` more leaves MEMORY_RESERVE of the memory available (Linux's
    /proc/meminfo; elsewhere, always)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"] - nbytes >= MEMORY_RESERVE * info["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        return True


def keeps_bf16_copy(w: torch.Tensor, bf16_rows: int) -> bool:
    """Whether a CPU layer keeps its plain weight `w`, held now beside its packed copy, for the
    bf16 kernel: the plan gives it rows, `w` is bfloat16, the kernel builds, and the memory left
    stays above MEMORY_RESERVE (keeping what is held costs nothing more)."""
    return (bf16_rows > 0 and w.dtype == torch.bfloat16 and cpu_bf16.available()
            and room_for(0))


def prepack(layer: Any, bf16_rows: int = 0) -> bool:
    """Pack a loaded unquantized CPU layer's weight for oneDNN, dropping the dense copy
    (memory stays the same), or keeping it for the bf16 kernel where `bf16_rows` (the CPU
    plan's), the weight is bfloat16, the kernel builds and a second copy fits. A bfloat16
    weight oneDNN cannot pack here (AVX2) stays plain, for the bf16 kernel's few rows and
    float32 GEMMs' others (cpu_bf16.dense_linear). Returns whether it packed or kept it so;
    other layers are left as they are."""
    if type(layer.linear_method) is not UnquantizedLinearMethod:
        return False
    w = layer.weight.data
    packable = cpu_linear.can_pack(w)
    if not packable and not (bf16_rows > 0 and w.dtype == torch.bfloat16
                             and w.device.type == "cpu" and cpu_bf16.available()):
        return False
    del layer.weight
    layer.packed_weight = cpu_linear.pack(w) if packable else None
    keep = not packable or keeps_bf16_copy(w, bf16_rows)
    layer.bf16_weight = w.contiguous() if keep else None
    layer.bf16_rows = bf16_rows if keep else 0
    layer.linear_method = PackedLinearMethod()
    return True


def unpack(layer: Any) -> bool:
    """prepack's inverse: the dense weight back as the layer's `weight` Parameter (bit for
    bit), served by F.linear again. Returns whether the layer was packed."""
    if type(layer.linear_method) is not PackedLinearMethod:
        return False
    packed = layer.packed_weight
    # a plain weight may sit in a shared huge-page mapping: a copy of its own, as loaded
    weight = cpu_linear.unpack(packed) if packed is not None else layer.bf16_weight.clone()
    del layer.packed_weight
    for name in ("bf16_weight", "bf16_rows"):
        layer.__dict__.pop(name, None)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    set_loader(layer.weight, layer, layer.weight_loader)
    layer.linear_method = UnquantizedLinearMethod()
    return True


def shape_error(got: torch.Size, want: torch.Size) -> str:
    return (
        f"shape {tuple(got)} does not match the model's {tuple(want)}; "
        "does config.json belong to this checkpoint?"
    )


def set_loader(param: nn.Parameter, layer: Any, loader: Any) -> None:
    # Parameters carry their loader and expected shards so load_weights needs no layer lookup.
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = tuple(layer.shards)  # type: ignore[attr-defined]
