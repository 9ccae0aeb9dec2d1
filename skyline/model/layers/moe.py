"""Mixture-of-experts layers: the router (top-k experts per token, with the architecture's
normalization of their weights), the experts (stacked weights [E, ...] owned by an expert layer
with its own format method, quant/experts.py), and the block that joins them.

Where experts live plugs in through an `ExpertPlacement` (parallel/experts.py): which experts
this rank holds (a contiguous slice of the layer's), and the dispatch / combine steps around
them. On one rank it holds every expert and both steps are the identity. With tensor
parallelism (`GroupPlacement`) each rank holds 1/n of every expert's intermediate size (gate
and up rows, down columns, as vLLM splits them), runs every token on it and the group sums;
with --expert-parallel (`AllToAllPlacement`) tokens move to the ranks of their experts and
back; with --n-cpu-moe (`HostPlacement`) the experts live in host memory and run on the CPU.

Checkpoints name experts' tensors per expert, `<prefix>.experts.<e>.<gate|up|down>_proj.
<weight|bias|blocks|scales>` (Qwen3-MoE's own names; Mixtral's and gpt-oss's are brought to
them by their model files); `expert_param` maps such a name to the stacked parameter and the
(expert, part) shard it fills.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from skyline.config import ConfigError
from skyline.ops.gemv import gemv_or_linear
from skyline.ops.moe_route import route
from skyline.parallel.experts import (
    AllToAllPlacement,
    ExpertPlacement,
    GroupPlacement,
    HostPlacement,
)
from skyline.parallel.groups import ParallelLayout
from skyline.parallel.shard import even_shard
from skyline.quant.experts import UnquantizedExpertMethod, set_expert_loader
from skyline.quant.method import shape_error

SCORINGS = ("softmax", "softmax_renorm", "topk_softmax")
_EXPERT_NAME = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias|blocks|scales)$")
_SUFFIX = {"weight": "", "bias": "_bias", "blocks": "_blocks", "scales": "_scales"}


def expert_param(hf_name: str) -> tuple[str, tuple[int, str]] | None:
    """(stacked parameter name, (expert, part)) of a per-expert checkpoint name, else None."""
    m = _EXPERT_NAME.match(hf_name)
    if m is None:
        return None
    prefix, e, part, kind = m.groups()
    proj = "w2" if part == "down" else "w13"
    return f"{prefix}.{proj}{_SUFFIX[kind]}", (int(e), part)


def expert_hf_name(name: str, shard_id: Any) -> str | None:
    """The per-expert checkpoint name of shard (expert, part) of stacked parameter `name`."""
    m = re.match(r"^(.*\.experts)\.(w13|w2)(_bias|_blocks|_scales)?$", name)
    if m is None or not isinstance(shard_id, tuple):
        return None
    kind = {v: k for k, v in _SUFFIX.items()}[m.group(3) or ""]
    return f"{m.group(1)}.{shard_id[0]}.{shard_id[1]}_proj.{kind}"


class Router(nn.Module):
    """hidden [T, H] -> (weights [T, k] float32, expert ids [T, k]): logits x W^T (+ b) in the
    model dtype, then `scoring`: "softmax" (Qwen3-MoE: the top-k of the softmax over all
    experts), "softmax_renorm" (Mixtral, Qwen3-MoE with norm_topk_prob: those renormalized to
    sum to 1), "topk_softmax" (gpt-oss: a softmax over the top-k logits)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str,
                 bias: bool = False) -> None:
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"unknown router scoring {scoring!r}; expected one of {SCORINGS}")
        self.top_k, self.scoring = top_k, scoring
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = gemv_or_linear(x, self.weight, self.bias)  # [T, E]; the Triton GEMV in decode
        return route(logits, self.top_k, self.scoring)  # one launch on CUDA (ops/moe_route.py)

    def extra_repr(self) -> str:
        e, h = self.weight.shape
        return f"{h} -> {e} experts, top {self.top_k}, {self.scoring}"


class FusedExperts(nn.Module):
    """The experts held here, each y = down(act(gate x, up x)) (+ biases), run together
    (ops/moe.py). Weights and their format belong to `expert_method` (quant/experts.py):
    w13 [E, 2I, H] (gate then up) and w2 [E, H, I] as that format stores them; biases
    `w13_bias` [E, 2I] and `w2_bias` [E, H] in the model dtype. `activation`: "silu"
    (SwiGLU) or "swiglu_oai" (gpt-oss's, clamped at `swiglu_limit`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 bias: bool = False, activation: str = "silu",
                 swiglu_limit: float | None = None,
                 placement: ExpertPlacement | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.activation, self.swiglu_limit = activation, swiglu_limit
        self.bias = bias
        self.expert_method: Any = UnquantizedExpertMethod()
        # tensor parallelism without --expert-parallel: (first, count, rank) of the
        # intermediate size this rank holds of every expert; None: all of it
        self.full_intermediate = intermediate_size
        self.i_shard: tuple[int, int, int] | None = None
        self._place(placement or ExpertPlacement(num_experts))

    def _place(self, placement: ExpertPlacement) -> None:
        """Hold `placement`'s experts: the weights made anew (before they are loaded)."""
        self.placement = placement
        self.expert_ids = placement.local
        self.num_experts = len(self.expert_ids)
        for name in list(self._parameters):
            delattr(self, name)
        self.expert_method.create_weights(self)
        if self.bias:
            for proj, rows in (("w13", 2 * self.intermediate_size), ("w2", self.hidden_size)):
                param = nn.Parameter(torch.empty(self.num_experts, rows), requires_grad=False)
                setattr(self, f"{proj}_bias", param)
                set_expert_loader(param, self, proj)
        # built on the host: loading moves it to the parameters' device (model/loader.py)
        self.register_buffer("expert_map", placement.expert_map(), persistent=False)

    def shard(self, layout: ParallelLayout) -> None:
        """With expert parallelism: this rank's slice of the experts, tokens moved to them
        (AllToAllPlacement). With tensor parallelism: 1/n of every expert's intermediate
        size (gate and up rows, down columns; balanced whatever the routing), every token
        run on it and the partial outputs summed over the group (GroupPlacement holding
        every expert)."""
        num = self.placement.num_experts
        if layout.ep.size > 1:
            self._place(AllToAllPlacement.of(num, layout.ep))
        elif layout.tp.size > 1:
            tp = layout.tp
            first, count = even_shard(self.full_intermediate, tp.size, tp.index,
                                      "experts' intermediate size")
            if getattr(self.expert_method, "fmt", None) == "mxfp4" and count % 32:
                raise ConfigError(
                    f"MXFP4 experts split over --tensor-parallel-size {tp.size} would hold "
                    f"{count} of their {self.full_intermediate} intermediate features each, "
                    "not whole blocks of 32; use --expert-parallel or another size")
            self.intermediate_size = count
            self.i_shard = (first, count, tp.index)
            self._place(GroupPlacement(num, group=tp))

    def place_on_host(self) -> None:
        """Hold every expert in host memory, run by the CPU (--n-cpu-moe)."""
        self._place(HostPlacement(self.placement.num_experts))

    @property
    def weight_device(self) -> str | None:
        """Where the expert weights live when not on the layer's device (loader.materialize)."""
        return "cpu" if self.placement.host else None

    def checkpoint_shape(self, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
        """The shape of one expert's checkpoint tensor (shard (expert, part)) of `param`,
        whatever part of the intermediate size this rank holds."""
        rows, *rest = param.shape[1:]
        if shard_id[1] != "down":
            rows = rows // 2 if self.i_shard is None else self.full_intermediate
        elif rest and self.i_shard is not None:
            rest[-1] = rest[-1] * self.full_intermediate // self.intermediate_size
        return (rows, *rest)

    def set_expert_method(self, method: Any) -> None:
        """Replace the weight layout before loading (quant/ does this; model files never do).
        Call under the same default device and dtype as the model's construction."""
        for name in [n for n in self._parameters if not n.endswith("_bias")]:
            delattr(self, name)
        self.expert_method = method
        method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: Any = None) -> None:
        """Copy one expert's checkpoint tensor (shard (expert, part)) into its rows of the
        stacked `param` (or let the format keep it: its `hold`); experts held by another rank
        are skipped."""
        e, part = shard_id
        if e not in self.expert_ids:
            return
        hold = getattr(self.expert_method, "hold", None)
        if hold is not None:  # a format that keeps checkpoint tensors as they come (GGUF)
            loaded = hold(self, loaded, shard_id)
            if loaded is None:
                return
        dst = param.data[e - self.expert_ids.start]
        if self.i_shard is not None:
            loaded = self._intermediate_part(loaded, part, param.dtype == torch.uint8)
        if part != "down":  # gate rows, then up rows
            half = dst.shape[0] // 2
            dst = dst.narrow(0, 0 if part == "gate" else half, half)
        if loaded.dim() > dst.dim():  # MXFP4 blocks [rows, K / 32, 16]
            loaded = loaded.flatten(dst.dim() - 1)
        if dst.shape != loaded.shape:
            raise ConfigError(shape_error(loaded.shape, dst.shape))
        dst.copy_(loaded)

    def _intermediate_part(self, loaded: torch.Tensor, part: str, packed: bool
                           ) -> torch.Tensor:
        """This rank's part of one expert's checkpoint tensor under tensor parallelism: gate
        and up rows (weights, MXFP4 blocks and scales, biases), down columns (MXFP4's by
        blocks of 32: a scale and 16 bytes of codes each); the down bias is added by the
        first rank only, as the group sums the outputs."""
        assert self.i_shard is not None
        first, count, index = self.i_shard
        if part == "down" and loaded.dim() == 1:
            return loaded if index == 0 else torch.zeros_like(loaded)
        dim, unit = (0, 1) if part != "down" else (1, 32 if packed else 1)
        if loaded.dim() <= dim or loaded.shape[dim] * unit != self.full_intermediate:
            raise ConfigError(f"an expert's {part} tensor of shape {tuple(loaded.shape)} does "
                              f"not match the model's intermediate size "
                              f"{self.full_intermediate}; is the checkpoint complete?")
        return loaded.narrow(dim, first // unit, count // unit)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return self.expert_method.apply(self, x, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        held = self.placement
        return (f"{self.num_experts} of {held.num_experts} experts, {self.hidden_size} -> "
                f"{self.intermediate_size}, {self.activation}, "
                f"{getattr(self.expert_method, 'fmt', '?')}, bias={self.bias}")


class MoE(nn.Module):
    """A sparse MLP block: x [T, H] -> sum over its top-k experts of weight * expert(x)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 scoring: str, bias: bool = False, router_bias: bool = False,
                 activation: str = "silu", swiglu_limit: float | None = None,
                 placement: ExpertPlacement | None = None) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, scoring, router_bias)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, bias,
                                    activation, swiglu_limit, placement)

    def input_quant(self, x: torch.Tensor) -> str | None:
        """The MoE takes its input as it is (RMSNorm's `feeds`)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] each
        place = self.experts.placement
        routed = place.dispatch(x, weights, ids)
        return place.combine(self.experts(routed.x, routed.weights, routed.ids), routed)

