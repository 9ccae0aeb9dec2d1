"""Where a mixture-of-experts layer's experts live and how tokens reach them: an
`ExpertPlacement` holds a contiguous slice of the layer's experts (global ids [first,
first + count)) and wraps the experts in two steps, `dispatch` (the rows, routing weights and
expert ids the experts run here) and `combine` (the layer's whole output from what they
returned). The placements:

- `ExpertPlacement`: every expert, on the layer's device; both steps pass through.
- `GroupPlacement` (tensor parallelism): every rank of the group runs every token on what it
  holds and the group all-reduces the outputs. The layer holds all experts, each cut to 1/n
  of its intermediate size (model/layers/moe.py: balanced whatever the routing); a placement
  of a slice of whole experts works alike (the others' pairs read zero, ops/moe.py's
  expert_map).
- `AllToAllPlacement` (--expert-parallel): the same slices, but each rank routes only its
  1/n of the tokens (the group's ranks hold the same hidden states), sends each (token,
  expert) pair's row to the rank holding the expert and gets the results back (all-to-all
  both ways), weights and sums them per token, and the group all-gathers the token slices.
  A rank computes only pairs routed to its experts, and its expert weights are read once for
  the group's tokens, not once per rank.
- `HostPlacement` (--n-cpu-moe): every expert in host memory, run by the CPU for a layer whose
  other weights are on a GPU: the routed tokens' rows cross to the host and back, once each
  way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from skyline.parallel.groups import Group
from skyline.parallel.shard import split_evenly


@dataclass
class Routed:
    """What dispatch hands the experts: rows x [R, H], routing weights [R, k] (float32) and
    global expert ids [R, k]; `state` is what combine needs to undo the dispatch."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    state: Any = None


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

    @property
    def host(self) -> bool:
        """The experts' weights live in host memory, whatever the layer's device."""
        return False

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
                 ) -> Routed:
        """The tokens (and their routing) this rank's experts run: every token, here."""
        return Routed(x, topk_weights, topk_ids)

    def combine(self, y: torch.Tensor, routed: Routed) -> torch.Tensor:
        """The whole output [T, H] from what this rank's experts returned for `routed`: that
        output, here."""
        return y


def _slices(num: int, group: Group) -> list[tuple[int, int]]:
    """(first, count) of each member's share of `num` items (split_evenly)."""
    return [split_evenly(num, group.size, i) for i in range(group.size)]


@dataclass(frozen=True, eq=False)
class GroupPlacement(ExpertPlacement):
    """The experts [first, first + count) on this rank of `group` (all of them by default:
    the layer then holds a slice of each one's intermediate size); every rank runs every
    token, and the outputs are summed over the group."""

    group: Group | None = None

    @classmethod
    def of(cls, num_experts: int, group: Group) -> GroupPlacement:
        """Rank i of the group holds experts [i * E / n, (i + 1) * E / n) (whole experts; the
        first E mod n ranks one more)."""
        first, count = split_evenly(num_experts, group.size, group.index)
        return cls(num_experts, first, count, group)

    def combine(self, y: torch.Tensor, routed: Routed) -> torch.Tensor:
        assert self.group is not None
        return self.group.all_reduce(y)


@dataclass
class _Exchange:
    """What an all-to-all dispatch keeps for its combine."""

    num_tokens: int  # T: the group's tokens (every rank's hidden states hold them all)
    order: torch.Tensor  # [P] this rank's pairs sorted by the rank holding their expert
    send: list[int]  # pairs sent to each member
    recv: list[int]  # rows received from each member
    weights: torch.Tensor  # [t, k] this rank's tokens' routing weights (float32)


@functools.cache
def _owners(num_experts: int, size: int, device: str) -> torch.Tensor:
    # made once per layout and device: no host-to-device copy in every layer's dispatch
    shares = torch.tensor([split_evenly(num_experts, size, i)[1] for i in range(size)])
    return torch.repeat_interleave(torch.arange(size), shares).to(device)


@dataclass(frozen=True, eq=False)
class AllToAllPlacement(GroupPlacement):
    """Expert parallelism: whole experts sharded as GroupPlacement's, tokens moved to them.
    Every member holds the same T tokens; member i routes tokens split_evenly(T, n, i) (a
    share may be empty), sends each pair's row to the member holding its expert, runs the
    rows it receives (grouped by expert, with weight 1), sends the results back, applies the
    routing weights and sums each token's k rows; an all-gather then gives every member all
    T rows again. Collectives run in the same order on every member whatever the counts, so
    uneven and empty shares cannot deadlock; the counts cross to the host (one sync a layer,
    so CUDA graphs cannot capture it: engine/create/ runs such engines eagerly)."""

    def owners(self, device: torch.device) -> torch.Tensor:
        """[num_experts] int64: the member holding each expert."""
        assert self.group is not None
        return _owners(self.num_experts, self.group.size, str(device))

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> Routed:
        group = self.group
        assert group is not None
        num_tokens, top_k = topk_ids.shape
        if num_tokens == 0:  # the same on every member: no collective at all
            return Routed(x, topk_weights, topk_ids)
        first, count = split_evenly(num_tokens, group.size, group.index)
        ids = topk_ids[first:first + count].flatten().long()  # [P], P = count * k
        owner = self.owners(ids.device)[ids]
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=group.size)
        recv_counts = group.all_to_all(send_counts)
        send, recv = torch.stack([send_counts, recv_counts]).tolist()  # one host sync
        rows = x[first:first + count][order // top_k]  # [P, H] grouped by destination
        recv_x = group.all_to_all(rows, recv, send)
        recv_ids = group.all_to_all(ids[order], recv, send)
        weights = topk_weights[first:first + count].float()
        ones = torch.ones(recv_ids.shape[0], 1, dtype=torch.float32, device=x.device)
        return Routed(recv_x, ones, recv_ids[:, None],
                      _Exchange(num_tokens, order, send, recv, weights))

    def combine(self, y: torch.Tensor, routed: Routed) -> torch.Tensor:
        group, ex = self.group, routed.state
        if ex is None:  # no tokens
            return y
        assert group is not None and isinstance(ex, _Exchange)
        back = group.all_to_all(y, ex.send, ex.recv)  # [P, H] in the order sent
        pairs = torch.empty_like(back)
        pairs[ex.order] = back
        count, top_k = ex.weights.shape
        # each token's k rows summed in float32, in the order a single rank's kernel sums them
        mine = (pairs.float().view(count, top_k, y.shape[-1]) * ex.weights[..., None]).sum(1)
        mine = mine.to(y.dtype)
        shares = _slices(ex.num_tokens, group)
        most = shares[0][1]  # the first share is the largest
        padded = torch.zeros(most, y.shape[-1], dtype=y.dtype, device=y.device)
        padded[:count] = mine
        every = group.all_gather(padded, dim=0)  # [n * most, H]
        return torch.cat([every[i * most:i * most + n] for i, (_, n) in enumerate(shares)])


@dataclass(frozen=True, eq=False)
class HostPlacement(ExpertPlacement):
    """Every expert in host memory and run by the CPU (its threads), beside a layer on a
    GPU: the rows and their routing cross to the host, the output comes back."""

    @property
    def host(self) -> bool:
        return True

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> Routed:
        if x.device.type != "cuda":  # nothing to move
            return Routed(x, topk_weights, topk_ids, x.device)
        # three copies queued, one wait for them all (the CPU needs the rows now)
        parts = [t.to("cpu", non_blocking=True) for t in (x, topk_weights, topk_ids)]
        torch.cuda.current_stream(x.device).synchronize()
        return Routed(*parts, x.device)

    def combine(self, y: torch.Tensor, routed: Routed) -> torch.Tensor:
        # from pageable memory: the copy is done when `to` returns, so `y` may be reused
        return y.to(routed.state)
