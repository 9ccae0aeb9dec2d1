"""Linear layers on the CPU through oneDNN, with each weight packed once at load.

`F.linear` on a CPU tensor goes to MKL's GEMM, which repacks the weight on every call: for the
few rows of a decode step (1..16) that costs up to 2-3x a one-row product in float32, and the
default model's LM head (49,152 x 576) reads at ~12 GB/s. oneDNN's inner product with the
weight reordered into its blocked layout ahead of time (`torch.ops.mkldnn._reorder_linear_weight`,
the path torch's inductor uses for CPU linears) streams the weight at about twice that rate
and costs little more for 2..9 rows than for one, which is what makes verifying draft tokens
cheap on a CPU (`bench/cpu_linear_speed.py`). Row results mostly do not depend on how many
rows came with them, but that is not guaranteed: a one-row product over a long row (K = 1536)
takes another kernel and rounds differently (as MKL's float32 GEMM does for several M).

Float32 and bfloat16 weights; anything else (or a torch built without oneDNN) keeps F.linear.
The packed tensor is opaque (layout `torch._mkldnn`); `unpack` gives the [out, in] weight back
bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from skyline.ops import cpu_ext

_DTYPES = (torch.float32, torch.bfloat16)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The reference: x [..., K], weight [N, K], bias [N] -> [..., N]."""
    return F.linear(x, weight, bias)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can take the packed path on this machine and torch build."""
    return (weight.device.type == "cpu" and weight.dtype in _DTYPES and weight.dim() == 2
            and not weight.is_mkldnn and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and _dtype_supported(weight.dtype))


def _dtype_supported(dtype: torch.dtype) -> bool:
    """oneDNN packs bf16 and fp16 only on CPUs with their instructions (AVX-512 BF16/FP16 or
    AVX-NE-CONVERT); elsewhere such weights stay plain."""
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported",
             torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    return probe is None or bool(getattr(torch.ops.mkldnn, probe, lambda: True)())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (see can_pack) -> the same weight in oneDNN's blocked layout."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on "
                         f"{weight.device}; check can_pack first")
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The [N, K] dense weight a packed tensor holds (a copy)."""
    return packed.to_dense()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """linear_ref's contract with the weight from `pack`: x [..., K] in the weight's dtype."""
    n, k = packed.shape
    if x.shape[-1] != k or x.dtype != packed.dtype:
        raise ValueError(f"packed_linear: x {x.dtype} {tuple(x.shape)} does not match the "
                         f"packed {packed.dtype} weight {(n, k)}")
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], n)
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], n)


def exact_near_top(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   margin: float = 8.0, limit_per_row: int = 1024) -> torch.Tensor:
    """Logits [n, V] of an approximate head (activations rounded to int8: errors of ~1e-2 on
    every entry) with the entries within `margin` of each row's maximum recomputed as a
    16-bit head's near-max entries are (x [n, K] @ weight [V, K]^T in float32, in place): the
    argmax and the probabilities that matter (e^-8 of the top's and more) are then those of
    the exact head, as a prompt scored later by the dense head gives them. A row with more
    than `limit_per_row` such entries is left as computed."""
    if logits.numel() == 0:
        return logits
    if _native_near_top(logits, x, weight):
        torch.ops.skyline_cpu.near_top_(logits, x, weight, margin, 0.0, limit_per_row)
        return logits
    return recompute_near_top_ref(logits, x, weight, margin, limit_per_row)


def exact_near_max(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   limit_per_row: int = 64) -> torch.Tensor:
    """Logits [n, V] of a 16-bit head (x [n, K] @ weight [V, K]^T, float32 sums rounded to the
    weight's dtype, then upcast) with the entries near each row's maximum recomputed in float32.

    Rounding the output is what costs: at a logit of 16 a bfloat16 step is 0.125, so a model's
    near-ties become exact ties and the greedy token turns on the vocabulary index. A rounded
    entry is within half a step of its float32 sum, so the float32 maximum lies within one step
    of the rounded one; those entries (a few per row) are recomputed, in place, and argmax picks
    what a float32 head would. A degenerate row with more than `limit_per_row` entries that
    close (a zero model) is left as it is. Float32 weights return logits untouched."""
    if weight.dtype == torch.float32 or logits.numel() == 0:
        return logits
    rel = 2 * torch.finfo(weight.dtype).eps
    if _native_near_top(logits, x, weight):
        torch.ops.skyline_cpu.near_top_(logits, x, weight, 1e-6, rel, limit_per_row)
        return logits
    margin = logits.amax(-1, keepdim=True).abs() * rel + 1e-6
    return recompute_near_top_ref(logits, x, weight, margin, limit_per_row)


def _native_near_top(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether csrc/cpu_decode.cpp's near_top_ takes these (one call, where the reference's
    six operations cost a batch-1 step of the default model ~0.6 ms)."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and x.dim() == 2 and x.dtype in _DTYPES and weight.dtype in _DTYPES
            and logits.is_contiguous() and x.is_contiguous() and weight.is_contiguous()
            and not x.requires_grad and cpu_ext.available())


def recompute_near_top_ref(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           margin: float | torch.Tensor, limit_per_row: int) -> torch.Tensor:
    """The entries within `margin` of their row's maximum, in float32, in place (unless a row
    averages more than limit_per_row of them)."""
    top = logits.amax(-1, keepdim=True)
    rows, cols = (logits >= top - margin).nonzero(as_tuple=True)
    if rows.numel() > limit_per_row * logits.shape[0]:
        return logits
    logits[rows, cols] = (x.reshape(-1, x.shape[-1])[rows].float() * weight[cols].float()).sum(-1)
    return logits
