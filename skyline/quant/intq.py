"""INT8 and INT4 weight-only quantization, group-wise asymmetric (ops/int_matmul.py layout).

Each group of `group_size` input elements of a row gets a float32 scale and an integer zero
point, so q = clamp(round(w / scale) + zero, 0, 2^bits - 1) and w ~ (q - zero) * scale; the
range always includes 0, so zero padding dequantizes to exactly 0. On the CPU, bfloat16
inputs run torch's int4 kernel (ops/cpu_int4.py; INT8 as two 4-bit planes), whose planes are
made at the first such call and kept beside the packed tensors, or, in a CPU engine serving in
bfloat16, made at load in their place; float32 inputs dequantize the weight at each call (the
exact reference). With calibration statistics, each group's range is clipped to the ratio that
minimises the activation-weighted error sum_k E[x_k^2] (w_k - w'_k)^2: an outlier weight on a
quiet input channel is not worth coarsening the whole group for (AWQ/GPTQ-style clip search).

On CUDA, decode-sized batches (<= 8 rows) of INT4 in groups of 32k run the W4A8 GEMV
(ops/gemv_int_a8.py: x rounded to int8 per 32 columns, `dp4a`; faster than the weight-only
GEMV, not exact in x: on the default model its rounding of x alone costs a KL of 0.005 against
the 0.53-0.66 of INT4's weights, bench/results/quant/quant-quality-cpu-smollm2-w4a8.json). The
kernel that makes x (RMSNorm, SiLU-and-mul, the split-KV combine of a decode batch's attention)
hands it over rounded (Linear.input_quant); the GEMV rounds any other x by a launch of its own.

Checkpoints of other tools (GPTQ, AWQ, compressed-tensors; quant/external/) load into this
layout; those quantized in activation order also gather x by the layer's `in_perm`
(quant/act_order.py).
"""

from __future__ import annotations

import torch

from skyline.ops import cpu_int4
from skyline.ops.gemv_int_a8 import CHUNK, Int8Chunks, int4_gemv_a8, quantize_chunks_int8_ref
from skyline.ops.gemv_quant import quant_gemv_ok
from skyline.ops.int_matmul import dequantize_int_ref, int_matmul_triton
from skyline.quant.act_order import fold_act_order, shard_index_loader, unpermute
from skyline.quant.base import (
    QuantLinearMethod,
    int_codes_linear,
    pack_nibbles,
    pad_cols,
    unpack_nibbles,
)
from skyline.quant.method import LinearLayer, iter_linears

CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5


def quantize_groups(
    w: torch.Tensor, bits: int, group: int, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, K] float -> (codes uint8 [R, Kp], scales float32 [R, G], zeros uint8 [R, G])."""
    qmax = 2**bits - 1
    wg = pad_cols(w.float(), group).reshape(w.shape[0], -1, group)  # [R, G, group]
    hi, lo = wg.amax(-1).clamp(min=0), wg.amin(-1).clamp(max=0)  # [R, G]
    ratios = CLIP_RATIOS if importance is not None else (1.0,)
    if importance is not None:
        imp = pad_cols(importance.float().reshape(1, -1), group).reshape(1, -1, group)
    best = None
    for r in ratios:
        scale = (hi - lo) * r / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo * r / scale).clamp(0, qmax)
        q = (torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, qmax)
        if best is None:
            best = (q, scale, zero)
            if importance is None:
                break
            err_best = ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - wg).square()
            err_best = (err_best * imp).sum(-1)
            continue
        err = (((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - wg).square() * imp).sum(-1)
        take = err < err_best  # [R, G]
        err_best = torch.where(take, err, err_best)
        best = (torch.where(take.unsqueeze(-1), q, best[0]), torch.where(take, scale, best[1]),
                torch.where(take, zero, best[2]))
    q, scale, zero = best
    return (q.reshape(w.shape[0], -1).to(torch.uint8), scale.float(), zero.to(torch.uint8))


class IntLinearMethod(QuantLinearMethod):
    """Weight-only INT8 or INT4 (two codes per byte)."""

    coarse = ("scales", "zeros")

    def __init__(self, cfg, bits: int) -> None:
        super().__init__(cfg)
        self.bits = bits
        self.name = f"int{bits}"
        self.column_block = self.group_size

    def param_specs(self, rows: int, cols: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        num_groups = -(-cols // self.group_size)
        packed = num_groups * self.group_size * self.bits // 8
        return {
            "qweight": ((rows, packed), torch.uint8),
            "scales": ((rows, num_groups), torch.float32),
            "zeros": ((rows, num_groups), torch.uint8),
        }

    def quantize(
        self, w: torch.Tensor, act_sq: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        codes, scales, zeros = quantize_groups(w, self.bits, self.group_size, act_sq)
        if self.bits == 4:
            codes = pack_nibbles(codes)
        return {"qweight": codes, "scales": scales, "zeros": zeros}

    def dequantize(self, q: dict[str, torch.Tensor], cols: int) -> torch.Tensor:
        w = dequantize_int_ref(q["qweight"], q["scales"], q["zeros"], self.bits, self.group_size)
        return w[:, :cols]

    def load_specs(self, layer: LinearLayer) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.layout is None or not self.layout.act_order:
            return {}
        return {"g_idx": ((len(layer.shards), layer.in_features), torch.int32)}

    def loader(self, layer: LinearLayer, name: str):
        return shard_index_loader(layer) if name == "g_idx" else super().loader(layer, name)

    def finish_prequantized(self, layer: LinearLayer) -> None:
        if "g_idx" in layer._parameters:
            fold_act_order(layer, self.bits, self.group_size)

    def prepack_cpu(self, layer: LinearLayer, dtype: torch.dtype) -> bool:
        """For a CPU engine in bfloat16 (loader.prepack_for_cpu; tools that save weights never
        call it): the int4 kernel's planes replace the packed tensors, so the layer holds about
        as many bytes as the codes (4.25 bits a weight for INT4 in groups of 128, 8.5 for INT8)."""
        if dtype != torch.bfloat16 or self._cpu_planes(layer) is None:
            return False
        for name in ("qweight", "scales", "zeros"):
            delattr(layer, name)
        return True

    def dequantized_weight(self, layer: LinearLayer) -> torch.Tensor:
        if not hasattr(layer, "qweight"):  # prepacked: read back from the kernel's planes
            w = cpu_int4.planes_weight(layer.int_planes)[:, : layer.in_features]
        else:
            w = super().dequantized_weight(layer)
        return unpermute(w, getattr(layer, "in_perm", None))

    def apply(self, layer: LinearLayer, x: torch.Tensor | Int8Chunks) -> torch.Tensor:
        # x comes as Int8Chunks when input_quant asked its producer for them
        if (perm := getattr(layer, "in_perm", None)) is not None:
            x = x.index_select(-1, perm)  # activation order: input_quant asked for plain x
        if isinstance(x, Int8Chunks) or self._w4a8(layer, x):
            return int4_gemv_a8(x, layer.qweight, layer.scales, layer.zeros, self.group_size,
                                bias=layer.bias)
        if not hasattr(layer, "qweight"):  # prepacked for the CPU: every input on the planes
            return cpu_int4.planes_linear(x, layer.int_planes, layer.bias)
        if (not x.is_cuda and x.dtype == torch.bfloat16
                and (planes := self._cpu_planes(layer)) is not None):
            return cpu_int4.planes_linear(x, planes, layer.bias)
        args = (layer.qweight, layer.scales, layer.zeros, self.bits, self.group_size)
        if x.is_cuda and self.group_size % 32:  # the GEMV is for groups of 32k only
            y = int_matmul_triton(x, *args)
            return y if layer.bias is None else y + layer.bias
        return int_codes_linear(x, *args, bias=layer.bias)

    def input_quant(self, layer: LinearLayer, x: torch.Tensor) -> str | None:
        """"int8" where x, about to be made by a norm or activation kernel, should come rounded
        (Int8Chunks) for this layer's W4A8 GEMV."""
        return "int8" if self._w4a8(layer, x) and not hasattr(layer, "in_perm") else None

    def _w4a8(self, layer: LinearLayer, x: torch.Tensor) -> bool:
        """Whether x (or the x about to be made) goes to the W4A8 GEMV."""
        return (self.bits == 4 and self.group_size % CHUNK == 0
                and hasattr(layer, "qweight") and layer.zeros.dtype == torch.uint8
                and quant_gemv_ok(x))

    def _cpu_planes(self, layer: LinearLayer) -> tuple[cpu_int4.Plane, ...] | None:
        """The layer's codes as planes of torch's CPU int4 kernel (ops/cpu_int4.py: one for
        INT4, two for INT8), made at the first bfloat16 call on the CPU and kept beside the
        packed tensors (None where the kernel is missing or cannot take the shape)."""
        if not hasattr(layer, "int_planes"):
            planes = None
            if cpu_int4.has_kernel():
                q = unpack_nibbles(layer.qweight) if self.bits == 4 else layer.qweight
                scale = layer.scales.float()
                planes = cpu_int4.pack_planes(q, scale, -layer.zeros.float() * scale,
                                              self.group_size, wide=self.bits == 8)
            layer.int_planes = planes
        return layer.int_planes


def round_linear_inputs_int8(model: torch.nn.Module) -> None:
    """From now on every Linear's input is replaced by its int8 rounding per row and 32
    columns, the values the W4A8 GEMV multiplies (quantize_chunks_int8_ref), for every token:
    W4A8's activation error measured on any device (bench/quant_quality.py)."""
    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        q, scale = quantize_chunks_int8_ref(x2)
        deq = q.float() * scale.repeat_interleave(CHUNK, dim=1)[:, : x2.shape[1]]
        return (deq.to(x.dtype).reshape(x.shape),)

    for layer in iter_linears(model):  # (the LM head is not one)
        layer.register_forward_pre_hook(hook)
