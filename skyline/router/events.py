"""The router's side of KV events (engine/kv_events.py): one subscriber per replica keeps that
replica's part of the prefix index and its load current.

It starts from a snapshot, then applies each batch in sequence. A gap (a batch PUB dropped,
or one sent before the subscription took hold), a new epoch (the engine restarted) or a
snapshot that does not come resynchronizes: the replica's entry is replaced by a fresh
snapshot, and batches it already includes are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from skyline.router.index import PrefixIndex
from skyline.router.replica import Replica
from skyline.types import KVEventBatch, KVEventKind, KVSnapshot

log = logging.getLogger("skyline.router")

SNAPSHOT_TIMEOUT_S = 10.0  # a step of a long prefill on a CPU can take seconds
SILENCE_S = 5.0  # no batch for this long (heartbeats come every second): resynchronize


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class EventSubscriber:
    """Follows one replica's KV events until `close`."""

    def __init__(self, ctx: zmq.asyncio.Context, replica: Replica, index: PrefixIndex,
                 snapshot_timeout_s: float = SNAPSHOT_TIMEOUT_S,
                 silence_s: float = SILENCE_S) -> None:
        assert replica.kv_events_port is not None
        self.replica = replica
        self.index = index
        self.snapshot_timeout_s = snapshot_timeout_s
        self.silence_s = silence_s
        host = replica.host
        where = f"[{host}]" if ":" in host else host
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self.sub.setsockopt(zmq.IPV6, 1)
            self.dealer.setsockopt(zmq.IPV6, 1)
        self.sub.connect(f"tcp://{where}:{replica.kv_events_port}")
        self.dealer.connect(f"tcp://{where}:{replica.kv_events_port + 1}")
        self.epoch: str | None = None
        self.seq = 0
        self.num_batches = 0
        self.num_resyncs = 0
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.sub.close(linger=0)
        self.dealer.close(linger=0)

    async def _run(self) -> None:
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:  # a malformed message: start over from a snapshot
                log.exception("KV events of %s: resynchronizing", self.replica.name)
                self.epoch = None
                await asyncio.sleep(0.5)

    async def _follow(self) -> None:
        if self.epoch is None and not await self.resync():
            await asyncio.sleep(1.0)
            return
        if not await self.sub.poll(self.silence_s * 1000):
            self.epoch = None  # silent: restarted elsewhere, or batches lost
            return
        _, payload = await self.sub.recv_multipart()
        batch = KVEventBatch.from_wire(_unpack(payload))
        self.replica.load = batch.load
        if batch.epoch != self.epoch or batch.seq > self.seq + 1:
            self.epoch = None  # a gap or a new engine
            return
        if batch.seq <= self.seq:
            return  # already in the snapshot (or a load-only batch)
        self.apply(batch)

    def apply(self, batch: KVEventBatch) -> None:
        r = self.replica.index
        for kind, hashes in batch.events:
            if kind == KVEventKind.STORED:
                self.index.store(r, hashes)
            elif kind == KVEventKind.REMOVED:
                self.index.remove(r, hashes)
            elif kind == KVEventKind.CLEARED:
                self.index.clear(r)
        self.seq = batch.seq
        self.num_batches += 1

    async def resync(self) -> bool:
        """Replace the replica's entry by a snapshot; False if none came in time."""
        nonce = os.urandom(8)
        await self.dealer.send_multipart([nonce])
        deadline = asyncio.get_running_loop().time() + self.snapshot_timeout_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            if not await self.dealer.poll(left * 1000):
                break
            frames = await self.dealer.recv_multipart()
            if frames[0] != nonce:
                continue  # the late answer to an earlier request
            snap = KVSnapshot.from_wire(_unpack(frames[1]))
            self.index.replace(self.replica.index, snap.hashes)
            self.epoch, self.seq = snap.epoch, snap.seq
            self.num_resyncs += 1
            return True
        self.index.clear(self.replica.index)  # unknown: predict nothing there
        return False
