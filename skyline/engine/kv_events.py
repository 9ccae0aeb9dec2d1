"""KV events: the engine tells a router which prefixes its cache holds, as vLLM's KV events do
for llm-d and Dynamo, so that the router can send a request where its prompt is cached.

The engine-core loop owns a `KVEventPublisher`. After every step (and after requests were
added or aborted) it takes the block pool's event log and publishes it, with the engine's
load, as one `KVEventBatch` on a ZMQ PUB socket:  [b"kv", msgpack(batch.to_wire())].
A batch with events gets the next sequence number; without events (load changes, at most every
LOAD_INTERVAL_S, or a heartbeat every HEARTBEAT_S when idle) it repeats the last one.

PUB drops what a subscriber is too slow for, or what was sent before it connected, so a
subscriber that sees a gap in the sequence (or a new epoch: the engine restarted) asks for a
snapshot on the ROUTER socket at the next port: it sends one frame (a nonce) and receives
[nonce, msgpack(KVSnapshot.to_wire())], the pool's hashes as of the last published seq.
Snapshots are answered between steps, after the step's events went out, so the two agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from skyline.engine.codec import pack
from skyline.types import KVEventBatch, KVSnapshot

TOPIC = b"kv"
LOAD_INTERVAL_S = 0.05  # a load-only batch at most this often
HEARTBEAT_S = 1.0  # a batch at least this often, even idle: subscribers see the engine alive
LOAD_KEYS = ("num_running", "num_waiting", "kv_usage")


class KVEventPublisher:
    """The engine side: a PUB socket for batches, a ROUTER socket for snapshots."""

    def __init__(self, host: str, port: int) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.snapshots = self.ctx.socket(zmq.ROUTER)
        self.snapshots.setsockopt(zmq.LINGER, 0)
        where = f"[{host}]" if ":" in host else host
        if ":" in host:
            self.pub.setsockopt(zmq.IPV6, 1)
            self.snapshots.setsockopt(zmq.IPV6, 1)
        try:
            self.pub.bind(f"tcp://{where}:{port}")
            self.snapshots.bind(f"tcp://{where}:{port + 1}")
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot publish KV events on {host}:{port} and {port + 1} ({e}); "
                          "pick another --kv-events-port") from None
        self.port = port
        self.epoch = uuid.uuid4().hex[:16]
        self.seq = 0
        self._sent_at = 0.0
        self._load: dict[str, float] = {}

    def publish(self, events: list[tuple[int, list[bytes]]], stats: dict[str, Any]) -> None:
        """Send the events (if any) and the load; load alone is rate-limited."""
        load = {k: float(stats.get(k, 0.0)) for k in LOAD_KEYS}
        now = time.monotonic()
        if events:
            self.seq += 1
        else:
            since = now - self._sent_at
            if since < LOAD_INTERVAL_S or (load == self._load and since < HEARTBEAT_S):
                return
        self._sent_at, self._load = now, load
        batch = KVEventBatch(self.epoch, self.seq, events, load)
        self.pub.send_multipart([TOPIC, pack(batch.to_wire())], copy=False)

    def answer_snapshots(self, hashes: Callable[[], list[bytes]]) -> None:
        """Answer every snapshot request waiting, without blocking."""
        while True:
            try:
                frames = self.snapshots.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue  # not a snapshot request
            snap = KVSnapshot(self.epoch, self.seq, hashes())
            self.snapshots.send_multipart([frames[0], frames[1], pack(snap.to_wire())])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.snapshots.close(linger=0)
        self.ctx.term()
