"""Mixture-of-experts layers: the router (top-k experts per token, with the architecture's
normalization of their weights), the experts (stacked weights [E, ...] owned by an expert layer
with its own format method, quant/experts.py), and the block that joins them.

Expert parallelism plugs in through `ExpertPlacement`: which experts this rank holds (a
contiguous slice of the layer's), and the dispatch / combine steps around the experts. On one
rank it holds every expert and both steps are the identity. With a slice per rank the experts
compute only the pairs routed to their own experts (the others read zero, ops/moe.py's
expert_map), so a placement whose combine sums over the ranks of its process group (all-reduce;
or all-to-all around dispatch) gives every rank the whole output. With tensor parallelism the
experts are split so over the tensor-parallel group (`GroupPlacement`): each rank sees every
token (its hidden states are the group's), runs its own experts' pairs, and the group sums.

Checkpoints name experts' tensors per expert, `<prefix>.experts.<e>.<gate|up|down>_proj.
<weight|bias|blocks|scales>` (Qwen3-MoE's own names; Mixtral's and gpt-oss's are brought to
them by their model files); `expert_param` maps such a name to the stacked parameter and the
(expert, part) shard it fills.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.ops.moe_route import route
from skyline.parallel.groups import Group, ParallelLayout
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


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts of a layer this rank holds, global ids [first, first + count), and how
    tokens reach them. The default holds all of them, and dispatch / combine pass through."""

    num_experts: int
    first: int = 0
    count: int | None = None  # None: all from `first` on

    @property
    def local(self) -> range:
        count = self.num_experts - self.first if self.count is None else self.count
        return range(self.first, self.first + count)

    def expert_map(self) -> torch.Tensor | None:
        """[num_experts] int32: global id -> index among the experts held, -1 for the others;
        None when every expert is held."""
        if len(self.local) == self.num_experts:
            return None
        m = torch.full((self.num_experts,), -1, dtype=torch.int32, device="cpu")
        m[self.first:self.first + len(self.local)] = torch.arange(len(self.local), device="cpu",
                                                                   dtype=torch.int32)
        return m

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens (and their routing) this rank's experts run: every token, here."""
        return x, topk_weights, topk_ids

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The whole output from this rank's share: its share, here."""
        return y


@dataclass(frozen=True, eq=False)
class GroupPlacement(ExpertPlacement):
    """A contiguous slice of the experts on each rank of `group`; every rank runs every token,
    and the outputs are summed over the group."""

    group: Group | None = None

    @classmethod
    def of(cls, num_experts: int, group: Group) -> GroupPlacement:
        """Rank i of the group holds experts [i * E / n, (i + 1) * E / n) (whole experts; the
        first E mod n ranks one more)."""
        per, extra = divmod(num_experts, group.size)
        first = group.index * per + min(group.index, extra)
        return cls(num_experts, first, per + (group.index < extra), group)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        return self.group.all_reduce(y)


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
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
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
        """With tensor parallelism: this rank's slice of the experts (GroupPlacement)."""
        if layout.tp.size > 1:
            self._place(GroupPlacement.of(self.placement.num_experts, layout.tp))

    def checkpoint_shape(self, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
        """The shape of one expert's checkpoint tensor (shard (expert, part)) of `param`."""
        rows, *rest = param.shape[1:]
        return (rows if shard_id[1] == "down" else rows // 2, *rest)

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
        stacked `param`; experts held by another rank are skipped."""
        e, part = shard_id
        if e not in self.expert_ids:
            return
        dst = param.data[e - self.expert_ids.start]
        if part != "down":  # gate rows, then up rows
            half = dst.shape[0] // 2
            dst = dst.narrow(0, 0 if part == "gate" else half, half)
        if loaded.dim() > dst.dim():  # MXFP4 blocks [rows, K / 32, 16]
            loaded = loaded.flatten(dst.dim() - 1)
        if dst.shape != loaded.shape:
            raise ConfigError(shape_error(loaded.shape, dst.shape))
        dst.copy_(loaded)

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
        xs, weights, ids = place.dispatch(x, weights, ids)
        return place.combine(self.experts(xs, weights, ids))

