"""Process groups and their collectives, and each rank's place in the layout.

Ranks are numbered stage by stage: rank = stage * tp_size + tp_rank. Three kinds of group:
- `tp`: the tensor-parallel peers of one stage (all-reduce after row-parallel layers, the
  vocabulary gather of the LM head);
- `pipe`: the ranks of one tensor-parallel index across stages (hidden states stage to stage);
- `tokens`: the sampling rank (the last stage's tensor-parallel rank 0, "driver") and the
  first stage's ranks, which embed the tokens it samples.
Every rank holds one of each. A `Group` of one rank does nothing and needs no
torch.distributed, so layers hold one always; expert parallelism takes its own group from
`init_layout` alike. Collectives between ranks on different kinds of device (a CPU stage beside
a GPU one) go through host memory over gloo (`via_host`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from skyline.parallel.placement import Stage

# The environment of every rank process: NVLink multicast (NVLS) off, for NCCL and for torch's
# symmetric memory (the GPU hosts skyline runs on require it off).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class Group:
    """Some ranks that exchange tensors. Positions (`index`, `src`, `dst`) are within the
    group; `ranks` gives their global ranks."""

    def __init__(self, ranks: Sequence[int], rank: int, pg: Any = None,
                 via_host: bool = False) -> None:
        self.ranks = tuple(ranks)
        self.index = self.ranks.index(rank)
        self.size = len(self.ranks)
        self.pg = pg
        self.via_host = via_host

    @classmethod
    def single(cls) -> Group:
        return cls((0,), 0)

    def __repr__(self) -> str:
        return f"Group(ranks={self.ranks}, index={self.index})"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.pg)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's `t` (same shape), concatenated along `dim` in group order."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: torch.Tensor, out_splits: Sequence[int] | None = None,
                   in_splits: Sequence[int] | None = None) -> torch.Tensor:
        """Rows of `t` to every member in group order, `in_splits[i]` rows to member i;
        returns the rows received, `out_splits[i]` from member i (without splits: equal
        shares of `t`'s rows each way)."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        rows = t.shape[0] if out_splits is None else sum(out_splits)
        out = t.new_empty((rows, *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), None if out_splits is None else
                               list(out_splits), None if in_splits is None else list(in_splits),
                               group=self.pg)
        return out

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every member's `t` (same shape) concatenated along `dim` on member `dst`; None on
        the others."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.index == dst else None
        dist.gather(t, parts, dst=self.ranks[dst], group=self.pg)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, t: torch.Tensor, src: int = 0) -> Pending:
        """`t` from member `src` into `t` on the others; `.wait()` returns it on this device."""
        if self.size == 1:
            return Pending(t)
        import torch.distributed as dist

        buf = t.cpu() if self.via_host and t.device.type != "cpu" else t
        work = dist.broadcast(buf, self.ranks[src], group=self.pg, async_op=True)
        return Pending(buf, work, t.device)

    def send(self, t: torch.Tensor, dst: int) -> Pending:
        """Send `t` to member `dst` without waiting; keep the result until it is done."""
        import torch.distributed as dist

        buf = t.cpu() if self.via_host else t.contiguous()
        return Pending(buf, dist.isend(buf, self.ranks[dst], group=self.pg))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
             src: int) -> Pending:
        """Receive a tensor from member `src`; `.wait()` returns it on `device`."""
        import torch.distributed as dist

        host = self.via_host and device.type != "cpu"
        buf = torch.empty(tuple(shape), dtype=dtype, device="cpu" if host else device)
        return Pending(buf, dist.irecv(buf, self.ranks[src], group=self.pg), device)

    def min(self, value: int) -> int:
        """The smallest `value` over the group (a host value, through gloo)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return int(t.item())


class Pending:
    """A tensor an asynchronous transfer is filling (or reading); `wait()` returns it once the
    transfer is done, on `device` (a CUDA transfer is then ordered before the stream's next
    kernels, without the host waiting)."""

    def __init__(self, buf: torch.Tensor, work: Any = None,
                 device: torch.device | None = None) -> None:
        self.buf = buf
        self.work = work
        self.device = device
        self._value: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            if self.work is not None:
                self.work.wait()
            buf = self.buf
            self._value = buf if self.device is None or buf.device == self.device else \
                buf.to(self.device, non_blocking=True)
        return self._value


@dataclass
class ParallelLayout:
    """One rank's place: its groups, its pipeline stage and the layers the stage runs."""

    rank: int
    world_size: int
    stage: Stage
    stage_index: int
    num_stages: int
    tp: Group
    pipe: Group  # this tensor-parallel index across stages, in stage order
    tokens: Group  # the driver (position 0) and the first stage's ranks
    world: Group
    # expert parallelism (--expert-parallel): the group MoE layers spread their experts and
    # move tokens over (the stage's tensor-parallel group), else one rank
    ep: Group = field(default_factory=Group.single)
    # --n-cpu-moe: the experts of the MoE layers among the model's first `host_moe_layers`
    # layers live in host memory and run on the CPU
    host_moe_layers: int = 0

    @classmethod
    def single(cls, num_layers: int, device: str = "cpu", host_moe_layers: int = 0
               ) -> ParallelLayout:
        one = Group.single()
        return cls(0, 1, Stage(device, 0, num_layers), 0, 1, one, one, one, one,
                   host_moe_layers=host_moe_layers)

    @property
    def first(self) -> bool:
        """This stage embeds the tokens."""
        return self.stage_index == 0

    @property
    def last(self) -> bool:
        """This stage computes the logits."""
        return self.stage_index == self.num_stages - 1

    @property
    def driver(self) -> bool:
        """This rank samples the tokens and answers for the step."""
        return self.last and self.tp.index == 0

    @property
    def needs_tokens(self) -> bool:
        """This rank embeds sampled tokens it does not sample itself."""
        return self.first and not self.driver


def driver_rank(tp_size: int, num_stages: int) -> int:
    return (num_stages - 1) * tp_size


def init_layout(rank: int, stages: Sequence[Stage], tp_size: int, store: Any,
                timeout_s: float, expert_parallel: bool = False,
                host_moe_layers: int = 0) -> ParallelLayout:
    """Join the process group (over `store`, torch.distributed's rendezvous) and make this
    rank's groups. Every rank calls it, with the same stages. With `expert_parallel` the
    tensor-parallel group is also the expert-parallel one."""
    import torch.distributed as dist

    num_stages = len(stages)
    world = num_stages * tp_size
    kinds = {torch.device(s.device).type for s in stages}
    backend = "gloo" if kinds == {"cpu"} else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    stage_index, tp_rank = divmod(rank, tp_size)
    mixed = len(kinds) > 1

    def groups(rank_sets: list[list[int]], via_host: bool) -> Group:
        # new_group is collective: every rank creates every group, in the same order
        mine = None
        for ranks in rank_sets:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                mine = Group(ranks, rank, pg, via_host)
        assert mine is not None
        return mine

    tp = groups([[s * tp_size + t for t in range(tp_size)] for s in range(num_stages)], False)
    pipe = groups([[s * tp_size + t for s in range(num_stages)] for t in range(tp_size)], mixed)
    driver = driver_rank(tp_size, num_stages)
    token_ranks = [driver] + [t for t in range(tp_size) if t != driver]
    token_pg = dist.new_group(token_ranks) if len(token_ranks) > 1 else None
    token_group = (Group(token_ranks, rank, token_pg, mixed) if rank in token_ranks
                   else Group((rank,), rank))
    return ParallelLayout(rank, world, stages[stage_index], stage_index, num_stages, tp, pipe,
                          token_group, Group(range(world), rank, None, False),
                          tp if expert_parallel else Group.single(), host_moe_layers)
