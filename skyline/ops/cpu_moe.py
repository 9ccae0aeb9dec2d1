"""Mixture-of-experts MLPs on the CPU's integer dot kernel (ops/cpu_intdot.py): every expert's
gate-and-up and down weights packed for it, stacked over the experts ([E, N, ...] in each of an
IntDotWeight's tensors), as quant/gguf_experts.py holds a GGUF file's experts.

`moe_intdot_ref` groups the (token, expert) pairs by expert in Python (ops/moe.py's
moe_by_expert) and runs each expert that has pairs on the kernel; `moe_intdot` does the same
operations from C++ (csrc/cpu_moe.cpp), bit for bit, without the interpreter between experts:
at one token a Qwen3-30B-A3B-shaped layer's eight experts took 1.2 ms of Python around 0.8 ms
of products.
"""

from __future__ import annotations

import torch

from skyline.ops import cpu_ext
from skyline.ops.cpu_intdot import IntDotWeight, intdot_linear
from skyline.ops.moe import local_ids, moe_activation_ref, moe_by_expert


def expert(w: IntDotWeight, e: int) -> IntDotWeight:
    """Expert e's weight of stacked `w`."""
    return w._replace(codes=w.codes[e], scale=w.scale[e], offset=w.offset[e])


def moe_intdot_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w13: IntDotWeight, w2: IntDotWeight, activation: str = "silu",
                   limit: float | None = None, expert_map: torch.Tensor | None = None,
                   biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
                   ) -> torch.Tensor:
    """x [T, H] through each token's top-k experts (global ids; `expert_map` to this rank's)
    -> [T, H] in x's dtype: per expert, gate and up (+ bias), the activation, down (+ bias)."""

    def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        b13, b2 = (None if b is None else b[e] for b in biases)
        h = moe_activation_ref(intdot_linear(rows, expert(w13, e), b13), activation, limit)
        return intdot_linear(h, expert(w2, e), b2)

    return moe_by_expert(x, topk_weights, topk_ids, w13.codes.shape[0], mlp, expert_map)


def moe_intdot(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               w13: IntDotWeight, w2: IntDotWeight, activation: str = "silu",
               limit: float | None = None, expert_map: torch.Tensor | None = None,
               biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
               ) -> torch.Tensor:
    """moe_intdot_ref's result; from C++ for SwiGLU experts without biases on float32 or
    bfloat16 activations (Qwen3-MoE's, Mixtral's), else the reference itself."""
    if (activation != "silu" or biases != (None, None) or x.shape[0] == 0
            or x.dtype not in (torch.float32, torch.bfloat16) or not cpu_ext.available()):
        return moe_intdot_ref(x, topk_weights, topk_ids, w13, w2, activation, limit,
                              expert_map, biases)
    ids = local_ids(topk_ids, expert_map).view(topk_ids.shape)
    return torch.ops.skyline_cpu.moe_intdot(
        x.contiguous(), topk_weights, ids, w13.codes, w13.scale, w13.offset, w13.bits,
        w13.group, w2.codes, w2.scale, w2.offset, w2.bits, w2.group, w13.rounds)
