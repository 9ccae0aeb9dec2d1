"""KV events over real ZMQ sockets on loopback: the engine's publisher and the router's
subscriber agree, across a gap (batches sent before the subscription), a restart (a new
epoch on the same port) and a snapshot that never comes."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq.asyncio

from skyline.engine.kv_events import KVEventPublisher
from skyline.router.events import EventSubscriber
from skyline.router.index import PrefixIndex
from skyline.router.launch import free_port_pair
from skyline.router.replica import Replica
from skyline.types import KVEventKind

STORED, REMOVED, CLEARED = KVEventKind.STORED, KVEventKind.REMOVED, KVEventKind.CLEARED


class Engine:
    """A publisher whose snapshots a background thread answers, as the engine loop does."""

    def __init__(self, port: int) -> None:
        self.pub = KVEventPublisher("127.0.0.1", port)
        self.cached: set[bytes] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.answering = threading.Event()
        self.answering.set()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.wait(0.01):
            if self.answering.is_set():
                with self.lock:
                    self.pub.answer_snapshots(lambda: sorted(self.cached))

    def send(self, events: list[tuple[int, list[bytes]]], load: float = 0.0) -> None:
        with self.lock:
            for kind, hashes in events:
                if kind == STORED:
                    self.cached |= set(hashes)
                elif kind == REMOVED:
                    self.cached -= set(hashes)
                else:
                    self.cached.clear()
            self.pub.publish(events, {"num_running": load})

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close()


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_follow_gap_and_restart():
    port = free_port_pair()
    engine = Engine(port)
    # Sent before anyone listens: only a snapshot can tell the subscriber about these.
    engine.send([(STORED, [b"a", b"b"])])

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        replica = Replica(0, f"http://127.0.0.1:{port}", kv_events_port=port)
        index = PrefixIndex()
        sub = EventSubscriber(ctx, replica, index, snapshot_timeout_s=1.0, silence_s=2.0)
        sub.start()
        try:
            await until(lambda: index.match([b"a", b"b"], [0]) == {0: 2})
            assert sub.num_resyncs == 1
            await asyncio.sleep(0.3)  # the subscription takes hold
            engine.send([(STORED, [b"c"]), (REMOVED, [b"a"])], load=3.0)
            await until(lambda: index.num_hashes(0) == 2 and replica.load.get("num_running") == 3)
            assert index.match([b"a"], [0]) == {0: 0}
            # A gap: the engine's seq jumps (batches lost); the subscriber resyncs.
            engine.pub.seq += 5
            with engine.lock:
                engine.cached.add(b"lost")
            engine.send([(STORED, [b"d"])])
            await until(lambda: sub.num_resyncs == 2 and index.num_hashes(0) == 4)
            engine.send([(CLEARED, [])])
            await until(lambda: index.num_hashes(0) == 0)
            # A restart: a new engine (new epoch) on the same ports.
            engine.close()
            fresh = Engine(port)
            try:
                fresh.send([(STORED, [b"x"])])
                await until(lambda: index.match([b"x"], [0]) == {0: 1}, timeout=15)
                # No answer to a snapshot request: the entry is dropped, not kept stale.
                fresh.answering.clear()
                sub.epoch = None
                await until(lambda: index.num_hashes(0) == 0, timeout=15)
            finally:
                fresh.close()
        finally:
            await sub.close()
            ctx.term()

    try:
        asyncio.run(main())
    finally:
        if not engine.stop.is_set():
            engine.close()
