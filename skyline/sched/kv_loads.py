"""Requests whose KV comes through a KV connector (cache/connector.py): their admission, their
wait, and blocks a connector holds past a request's end. Without a connector it only frees.

A waiting request whose prefix the connector holds beyond the device's prefix hits is admitted
without compute: it takes device blocks for its hits and for the blocks to load, the load goes
out in this step's `SchedulerOutput.kv_transfers`, and the request waits in `loading`
(RequestStatus.WAITING_FOR_KV) while the other requests keep running: the worker copies on a
side stream or I/O threads. When the worker reports the load ended, the request joins the
running batch with `num_computed_tokens` at the end of what arrived — a block that failed, and
every block after it, is recomputed, never read — and is sent to the runner whole at its first
step (`take_unsent`). An aborted loading request keeps its blocks until its load ends (the
worker is writing into them); so does a finished request whose blocks the connector is still
sending.
"""

from __future__ import annotations

from skyline.cache.connector import KVConnectorScheduler
from skyline.cache.kv_manager import KVCacheBlock, KVCacheManager
from skyline.types import Request, RequestStatus, RunnerOutput, SchedulerOutput


class KVLoads:
    def __init__(self, connector: KVConnectorScheduler | None, kv_manager: KVCacheManager
                 ) -> None:
        self.connector = connector
        self.kv = kv_manager
        self.loading: dict[int, Request] = {}  # op id -> request waiting for it
        self._op_of: dict[str, int] = {}  # request id -> its load's op id
        self._held: dict[int, Request] = {}  # op id -> request whose blocks its end frees
        self._unsent: set[str] = set()  # loaded, running, not yet sent to the runner

    @property
    def busy(self) -> bool:
        """Whether transfers are in flight (the engine steps until they are reported)."""
        return self.connector is not None and bool(
            self.loading or self._held or self.connector.num_in_flight)

    @property
    def holds_blocks(self) -> bool:
        """Whether device blocks are held for transfers in flight (they come back when the
        transfers end)."""
        return bool(self.loading or self._held)

    def admit(self, req: Request, hits: list[KVCacheBlock], num_hit: int) -> bool | None:
        """Start loading what the connector holds of `req`'s prefix past the device's `hits`
        (`num_hit` tokens). True: the request now waits for it; False: nothing to load; None:
        its blocks do not fit now (admission stops, as for any request)."""
        if self.connector is None:
            return False
        bs = self.kv.block_size
        hashes = self.kv.block_hashes(req)
        # At least one token is computed, for its logits (as for device hits).
        stop = min(len(hashes), (req.num_tokens - 1) // bs)
        n = self.connector.num_matched_blocks(req, hashes, len(hits), stop)
        if not n:
            return False
        new_ids = self.kv.allocate_slots(req, n * bs, hits)
        if new_ids is None:
            return None
        req.status = RequestStatus.WAITING_FOR_KV
        req.num_computed_tokens = num_hit
        op = self.connector.load(req, hashes[len(hits) : len(hits) + n], new_ids[len(hits) :])
        self.loading[op] = req
        self._op_of[req.request_id] = op
        return True

    def build(self, out: SchedulerOutput) -> None:
        """The step's transfers into `out`."""
        if self.connector is not None:
            out.kv_transfers = self.connector.build()
            out.kv_in_flight = self.busy

    def update(self, runner_out: RunnerOutput) -> list[Request]:
        """Take the worker's report; returns the requests whose KV arrived, ready to run."""
        if self.connector is None or not runner_out.kv_finished:
            return []
        for op in runner_out.kv_finished:
            held = self._held.pop(op, None)
            if held is not None:
                self.kv.free(held)
        ready = []
        for ended in self.connector.update(runner_out.kv_finished, runner_out.kv_failed):
            req = self.loading.pop(ended.op_id, None)
            if req is None:
                continue
            del self._op_of[req.request_id]
            req.num_computed_tokens += ended.num_blocks * self.kv.block_size
            self.kv.cache_blocks(req, req.num_computed_tokens)  # now safe to share
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            self._unsent.add(req.request_id)
            ready.append(req)
        return ready

    def take_unsent(self, req: Request) -> bool:
        """Whether the runner has yet to be sent the request (whole); it is sent now."""
        if req.request_id not in self._unsent:
            return False
        self._unsent.discard(req.request_id)
        return True

    def release(self, req: Request, preempted: bool = False) -> None:
        """Free a request's blocks (finished, aborted or preempted), now or once a transfer of
        them ends."""
        self._unsent.discard(req.request_id)
        op = self._op_of.pop(req.request_id, None)
        if op is not None:  # aborted while its KV is loading
            del self.loading[op]
        elif self.connector is not None and not preempted:
            op = self.connector.request_finished(req, self.kv.block_ids(req.request_id))
        if op is None:
            self.kv.free(req)
        else:
            self._held[op] = req

    def holds(self, request_id: str) -> bool:
        """Whether blocks of a request by this id are still held (its id is not free)."""
        return bool(self._held) and any(r.request_id == request_id for r in self._held.values())

    def stats(self) -> dict[str, float]:
        return self.connector.stats() if self.connector is not None else {}

    def reset(self) -> int:
        return self.connector.reset() if self.connector is not None else 0
