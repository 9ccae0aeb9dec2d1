"""The scheduler's half of a KV connector: what moves between the device's KV cache and what
lies beyond it — lower tiers (cache/offload.py) now, another replica's blocks for
prefill/decode disaggregation, or an external store.

A connector is split the way the engine is. This half runs beside the scheduler in pure Python
and decides by block ids and chained block hashes; the worker's half (worker/connector/) runs
on every rank beside its runner and moves the tensors of its own shard. They speak only in
plain data: `SchedulerOutput.kv_transfers` (types.KVTransfer: op id, kind, keys, device
blocks, RAM slots, disk flags, a transport's parameters) and `RunnerOutput.kv_finished` /
`kv_failed`, which a multi-rank executor merges (worker/connector/base.py).

A step (sched/kv_loads.py drives it):
- admission: `num_matched_blocks` says how many blocks past the device's prefix hits the
  connector can supply. If any, the scheduler allocates device blocks for them and calls
  `load`; the request waits for them (RequestStatus.WAITING_FOR_KV), holding its blocks, while
  other requests run;
- the block pool reports blocks whose KV becomes findable (`block_cached`) and blocks about
  to be overwritten (`block_evicted`): a tier writes them down;
- `build` hands over the step's transfers; the runner starts them before its forward pass;
- `update` takes the worker's report: the loads that ended, each with how many of its leading
  blocks arrived. The request then runs from there: a block that failed and those after it
  are recomputed, never read.
- `request_finished` lets a connector keep a finished request's blocks until a transfer of
  them ends (a prefill replica whose KV a decode replica pulls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from skyline.cache.prefix import BlockHash
from skyline.types import KVTransfer, Request


@dataclass
class LoadEnded:
    """A load that ended: `num_blocks` of its leading blocks arrived."""

    op_id: int
    num_blocks: int


class KVConnectorScheduler:
    """The interface; every method is called by the scheduler's thread, between steps."""

    def num_matched_blocks(self, request: Request, hashes: Sequence[BlockHash], start: int,
                           stop: int) -> int:
        """How many of the blocks `hashes[start:stop]` (the device misses from `start`), in
        order from `start`, the connector can supply."""
        raise NotImplementedError

    def load(self, request: Request, hashes: Sequence[BlockHash],
             block_ids: Sequence[int]) -> int:
        """Plan the load of `hashes` into the request's device blocks `block_ids` (fresh
        blocks, which nobody else reads until the load ends). Returns the transfer's op id."""
        raise NotImplementedError

    def block_cached(self, block_id: int, block_hash: BlockHash) -> None:
        """Device block `block_id` now holds the computed KV of `block_hash`."""

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """Device block `block_id` (holding `block_hash`) is being reallocated this step."""

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> int | None:
        """A request finished: an op id whose end frees its blocks, or None to free them now."""
        return None

    def build(self) -> list[KVTransfer]:
        """The transfers this step starts."""
        raise NotImplementedError

    def update(self, finished: Sequence[int], failed: dict[int, list[int]]) -> list[LoadEnded]:
        """The worker's report (RunnerOutput.kv_finished / kv_failed); returns the loads that
        ended among them."""
        raise NotImplementedError

    @property
    def num_in_flight(self) -> int:
        """Transfers started and not reported ended, or decided and not started (the engine
        steps until there are none)."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        return {}

    def reset(self) -> int:
        """Forget every block held beyond the device (the KV is stale); returns how many."""
        return 0
