"""The worker's half of a KV connector; the scheduler's half (cache/connector.py) decides.

Each rank's runner owns one connector over its own shard of the KV cache and calls it at
three points, never between the engine's schedule / execute / update:
- `start(transfers)` when it launches a step, before the forward pass: stores first (their
  reads of device blocks are queued before any write of this step), then loads, spills and
  drops, all asynchronous where the device allows (copy streams, I/O threads);
- `poll()` when it builds a step's output: the transfers that ended since the last poll, and
  their failed blocks (`RunnerOutput.kv_finished` / `kv_failed`);
- `wait(timeout)` in a step with nothing to compute (requests only wait for KV), so the loop
  neither spins nor sleeps past a transfer's end.
What the scheduler's half needs at start-up (capacities, what a store already holds) comes
from `info()`, plain data. A multi-rank executor merges the ranks' answers with `merge_info`
and their reports with `ReportMerger`: a transfer ended when every rank ended it, and a block
failed if it failed on any rank.

Transports for prefill/decode disaggregation implement the same calls: a load with
`KVTransfer.params` names a peer to pull from, a finished request's blocks are sent by a
transfer the scheduler's half starts (`KVConnectorScheduler.request_finished`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from skyline.types import KVTransfer, RunnerOutput


class KVConnector:
    def info(self) -> dict[str, Any]:
        """What the scheduler's half needs at start-up (plain data)."""
        raise NotImplementedError

    def start(self, transfers: Sequence[KVTransfer]) -> None:
        """Start a step's transfers; called before the step's forward pass is queued."""
        raise NotImplementedError

    def poll(self) -> tuple[list[int], dict[int, list[int]]]:
        """Transfers that ended since the last poll, and the failed block indexes of those
        where some failed."""
        raise NotImplementedError

    def wait(self, timeout: float) -> None:
        """Return once a transfer has ended (for `poll` to report), or after `timeout` s."""
        raise NotImplementedError

    @property
    def num_in_flight(self) -> int:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Finish writes in flight and release memory (idempotent)."""


def merge_info(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One view of every rank's `info()`: the least room, the blocks every rank has."""
    first = infos[0]
    common = set(first["disk_found"])
    for i in infos[1:]:
        common &= set(i["disk_found"])
    return {
        "ram_slots": min(i["ram_slots"] for i in infos),
        "disk_blocks": min(i["disk_blocks"] for i in infos),
        "disk_writable": all(i["disk_writable"] for i in infos),
        "disk_found": [k for k in first["disk_found"] if k in common],
        "ram_is_buffer": first["ram_is_buffer"],
    }


class ReportMerger:
    """A multi-rank executor's merge of its ranks' reports: an op ends once all `num_ranks`
    reported it (ranks may report it in different steps)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._seen: Counter[int] = Counter()
        self._failed: dict[int, set[int]] = {}

    def merge(self, outputs: Sequence[RunnerOutput], into: RunnerOutput) -> None:
        """Set `into.kv_finished` / `kv_failed` from the ranks' outputs of one step."""
        done = []
        for out in outputs:
            for op in out.kv_finished:
                self._seen[op] += 1
                if self._seen[op] == self.num_ranks:
                    done.append(op)
            for op, bad in out.kv_failed.items():
                self._failed.setdefault(op, set()).update(bad)
        into.kv_finished = done
        into.kv_failed = {}
        for op in done:
            del self._seen[op]
            bad = self._failed.pop(op, None)
            if bad:
                into.kv_failed[op] = sorted(bad)
