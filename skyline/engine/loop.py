"""The engine core's loop in its process (engine/process.py): it reads the API processes'
messages, runs steps and pushes each client its outputs (the protocol: process.py's docstring).
"""

from __future__ import annotations

import logging
from typing import Any

from skyline.engine.codec import pack, request_from_dict, step_output_to_list, unpack
from skyline.types import StepOutput

log = logging.getLogger(__name__)


class QueueTimes:
    """A step observer: the seconds each request waited before its first schedule (the
    queue-time metric), from the arrivals the loop records."""

    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}  # request id -> arrival, until first scheduled
        self.seconds: dict[str, float] = {}  # first scheduled since the last report

    def __call__(self, out: Any, scheduled_at: float, seconds: float) -> None:
        for new in out.new_requests:
            arrival = self.arrivals.pop(new.request_id, None)
            if arrival is not None:
                self.seconds[new.request_id] = scheduled_at - arrival

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


class EngineLoop:
    def __init__(self, core: Any, queue_times: QueueTimes, in_addrs: list[str],
                 out_addrs: list[str], events: Any = None) -> None:
        import zmq

        self.core = core
        self.queue_times = queue_times
        self.events = events  # a KVEventPublisher, or None
        self.ctx = zmq.Context()
        self.inp = self.ctx.socket(zmq.PULL)
        for addr in in_addrs:
            self.inp.connect(addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)
        if events is not None:
            self.poller.register(events.snapshots, zmq.POLLIN)
        self.outs = []  # one per client (API process), by client index
        for addr in out_addrs:
            out = self.ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow reader
            out.setsockopt(zmq.LINGER, 5000)
            out.connect(addr)
            self.outs.append(out)
        # requests added by each client, which lets the frontend count requests in flight to us
        self.num_adds = [0] * len(self.outs)
        # several clients: which one owns each request (its outputs go there only)
        self.owners: dict[str, int] = {}
        self.running = True
        self.stats_dirty = True

    def send(self, msg: Any, client: int = 0) -> None:
        self.outs[client].send(pack(msg))

    def stats(self) -> dict[str, Any]:
        s = dict(self.core.stats())
        s["max_model_len"] = self.core.max_model_len
        s["num_adds"] = self.num_adds[0]
        pool = self.core.scheduler.kv_manager.block_pool
        s["num_used_blocks"] = pool.num_blocks - pool.num_free_blocks  # 0 when idle
        return s

    def send_outputs(self, outputs: list[StepOutput], stats: dict[str, Any]) -> None:
        """One "out" message per client per step: its requests' outputs and queue times, and
        the engine's stats (every client reads them at scrape and for its waiting bound)."""
        queue_times = self.queue_times.take()
        if len(self.outs) == 1:
            self.send(("out", [step_output_to_list(o) for o in outputs], stats, queue_times))
            return
        owners = self.owners
        # queue times first: a request scheduled and finished in this step still has its owner
        times: list[dict[str, float]] = [{} for _ in self.outs]
        for rid, seconds in queue_times.items():
            times[owners.get(rid, 0)][rid] = seconds
        per_client: list[list[Any]] = [[] for _ in self.outs]
        for o in outputs:
            client = owners.get(o.request_id, 0)
            if o.finish_reason is not None:
                owners.pop(o.request_id, None)
            per_client[client].append(step_output_to_list(o))
        for client, outs in enumerate(per_client):
            self.send(("out", outs, {**stats, "num_adds": self.num_adds[client]},
                       times[client]), client)

    def _client(self, msg: list[Any], size: int) -> int:
        """The client index a message of `size` fields carries last (0 when it carries none);
        an index out of range (a bug) is client 0's."""
        client = msg[size] if len(msg) > size else 0
        return client if isinstance(client, int) and 0 <= client < len(self.outs) else 0

    def _abort(self, ids: list[str]) -> None:
        self.core.abort_requests(ids)
        for rid in ids:
            self.queue_times.arrivals.pop(rid, None)
            self.owners.pop(rid, None)

    def handle(self, msg: list[Any]) -> None:
        kind = msg[0]
        self.stats_dirty = True
        if kind == "add":
            client = self._client(msg, 2)
            self.num_adds[client] += 1
            rid = str(msg[1].get("id")) if isinstance(msg[1], dict) else "?"
            try:
                req = request_from_dict(msg[1])
                # The front end validated it; validate again here, where a value the sampler
                # cannot hold would otherwise fail a whole step, not just this request.
                req.sampling_params.validate(self.core.config.model.arch.vocab_size)
                self.core.add_request(req)
            except Exception as e:  # a bad request must not take the engine down
                if not isinstance(e, ValueError):
                    log.exception("request %s could not be added", rid)
                self.send(("add_error", rid, str(e)), client)
                return
            self.queue_times.arrivals[req.request_id] = req.arrival_time
            if len(self.outs) > 1:
                self.owners[req.request_id] = client
        elif kind == "abort":
            self._abort(msg[1])
        elif kind == "hello":  # a (new) API process at this index: drop its predecessor's work
            client = self._client(msg, 1)
            self._abort([rid for rid, c in self.owners.items() if c == client])
            self.num_adds[client] = 0  # it counts its own adds from 0
        elif kind == "call":
            client = self._client(msg, 4)
            _, call_id, method, args = msg[:4]
            if method == "stats":
                value: Any = {**self.stats(), "num_adds": self.num_adds[client]}
            elif method == "reset_prefix_cache":
                value = self.core.scheduler.reset_prefix_cache()
            else:
                value = None
            self.send(("result", call_id, value), client)
        elif kind == "shutdown":
            self.running = False

    def drain(self, block: bool) -> None:
        import zmq

        while block and self.running:
            ready = dict(self.poller.poll(1000))
            self.publish_events(None)  # snapshot requests, heartbeats
            if self.inp in ready:
                break
        while self.running:
            try:
                data = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(unpack(data))

    def publish_events(self, stats: dict[str, Any] | None) -> None:
        """Publish the cache's events since the last call, then answer snapshot requests
        (in this order, so that a snapshot includes every event published)."""
        if self.events is None:
            return
        pool = self.core.scheduler.kv_manager.block_pool
        self.events.publish(pool.take_events(), stats if stats is not None else self.stats())
        self.events.answer_snapshots(pool.cached_hashes)

    def run(self) -> None:
        while self.running:
            self.drain(block=not self.core.has_unfinished())
            if not self.running:
                break
            if not self.core.has_unfinished():
                if self.stats_dirty:  # e.g. everything was aborted: report the freed cache
                    stats = self.stats()
                    self.send_outputs([], stats)
                    self.publish_events(stats)
                    self.stats_dirty = False
                continue
            outputs = self.core.step()
            stats = self.stats()
            self.send_outputs(outputs, stats)
            self.publish_events(stats)
            self.stats_dirty = False

    def broadcast(self, msg: Any) -> None:
        for client in range(len(self.outs)):
            self.send(msg, client)

    def close(self) -> None:
        self.inp.close(linger=0)
        for out in self.outs:
            out.close()
        self.ctx.term()
        if self.events is not None:
            self.events.close()
