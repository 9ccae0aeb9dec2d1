"""The tiers' worker half: moves block payloads between the device, host RAM and disk.

On CUDA:
- store: the blocks are gathered into a payload on the compute stream (so the gather reads
  them after every earlier step wrote them, and before any later step overwrites them: the
  pool may reallocate a stored block at once), then copied to their RAM slots on a
  device-to-host stream, overlapped with the forward passes; disk writes (eager policy) run
  on I/O threads once that copy ended;
- load from RAM: host-to-device copies and the scatter into the blocks run on a second stream,
  behind an event of the compute stream (the fresh blocks' last users), in chunks;
- load from disk: I/O threads read and checksum files into a ring of pinned staging slots;
  each `poll` moves the reads that ended to the device as above, and recycles their slots once
  those copies ended;
- spill and drop: file writes and deletions on the I/O threads.
On the CPU the copies are plain, in the calling thread, and only the files are asynchronous.

A transfer ends when all its copies, reads and writes have; `poll` reports it with the
indexes of blocks whose file could not be read or written.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from skyline.config import ConfigError, EngineConfig
from skyline.types import KV_DROP, KV_LOAD, KV_SPILL, KV_STORE, KVTransfer
from skyline.worker.connector.base import KVConnector
from skyline.worker.connector.codec import BlockCodec
from skyline.worker.connector.disk import DiskStore
from skyline.worker.connector.fingerprint import fingerprint
from skyline.worker.connector.host import HostBuffer, runs
from skyline.worker.sampler import to_device

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # device staging per copy chunk
WRITE_BUFFER_BYTES = 1 << 30  # RAM slots when only a disk tier is asked for: its write buffer
STAGING_BYTES = 256 << 20  # pinned slots for reads from disk
DISK_SHARE = 0.9  # of the free space, when no disk size is given


@dataclass(eq=False)
class _Op:
    op: KVTransfer
    events: list[Any] = field(default_factory=list)  # device copies (CUDA events)
    futures: list[tuple[int, cf.Future]] = field(default_factory=list)  # block index, I/O
    failed: set[int] = field(default_factory=set)
    reads_left: int = 0  # disk reads not yet copied to the device


class TierWorker(KVConnector):
    def __init__(self, config: EngineConfig, kv_caches: list[torch.Tensor],
                 kv_scales: list[tuple[float, float]], rank: dict[str, int] | None = None
                 ) -> None:
        off = config.offload
        rank = rank or {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}
        # The tiers' sizes are the engine's: its ranks (each over its own shard of a block)
        # share them evenly, so that every rank holds about as many blocks as one process.
        share = rank["tp_size"] * rank["pp_size"]
        self.device = kv_caches[0].device
        self.cuda = self.device.type == "cuda"
        self.codec = BlockCodec(kv_caches, off.dtype)
        p = self.codec.payload_bytes
        self.chunk = max(1, CHUNK_BYTES // p)
        self.config_ram = off.ram_bytes > 0
        if off.ram_bytes:
            slots = off.ram_bytes // share // p
            if slots < 1:
                raise ConfigError(f"--kv-offload-ram {off.ram_bytes} bytes holds no block of "
                                  f"{p} bytes; give more")
        else:  # a disk alone: RAM slots as its write buffer, a few steps of evictions
            steps = config.scheduler.max_num_batched_tokens // config.cache.block_size
            slots = max(16, min(4 * steps, WRITE_BUFFER_BYTES // p))
        try:
            self.ram = HostBuffer(slots, p, pin=self.cuda)
        except RuntimeError as e:
            raise ConfigError(f"cannot allocate {slots * p / 2**30:.1f} GiB of host RAM for "
                              f"the KV tiers ({e}); lower --kv-offload-ram") from None
        self.disk: DiskStore | None = None
        self.disk_blocks = -1
        self._found: list[bytes] = []
        if off.disk_dir is not None:
            shape = (len(kv_caches), *kv_caches[0].shape[:1], *kv_caches[0].shape[2:])
            fp = fingerprint(config, str(kv_caches[0].dtype), kv_scales, shape, rank)
            self.disk = DiskStore(off.disk_dir, fp, p)
            self._found = self.disk.found()
            size = off.disk_bytes
            if size is None:
                held = len(self._found) * self.disk.file_bytes
                size = int((self.disk.free_bytes() + held * share) * DISK_SHARE)
            self.disk_blocks = size // share // self.disk.file_bytes
        self.staging = HostBuffer(max(4, STAGING_BYTES // p) if self.disk else 0, p,
                                  pin=self.cuda)
        self._staging_free = list(range(self.staging.num_slots))
        self._staging_busy: deque[tuple[Any, list[int]]] = deque()  # (event, slots)
        workers = min(8, max(2, (os.cpu_count() or 2) // 2))
        self.pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="kv-io")
        self.h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self.d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self._ops: dict[int, _Op] = {}
        self._read_queue: deque[tuple[_Op, int]] = deque()  # disk reads waiting for a slot
        self._reading: list[tuple[_Op, int, int, cf.Future]] = []  # op, block, slot, read
        log.info("KV tiers: %d RAM slots (%.2f GiB%s), disk %s (%d blocks, %d found), %d bytes "
                 "a block", slots, slots * p / 2**30, ", pinned" if self.ram.pinned else "",
                 self.disk.dir if self.disk else "off", max(self.disk_blocks, 0),
                 len(self._found), p)

    def info(self) -> dict[str, Any]:
        return {"ram_slots": self.ram.num_slots, "disk_blocks": self.disk_blocks,
                "disk_writable": bool(self.disk and self.disk.writable),
                "disk_found": list(self._found), "payload_bytes": self.codec.payload_bytes,
                "ram_is_buffer": not self.config_ram}

    @property
    def num_in_flight(self) -> int:
        return len(self._ops)

    # ---------------------------------------------------------------- start

    def start(self, transfers: Sequence[KVTransfer]) -> None:
        order = {KV_STORE: 0, KV_LOAD: 1, KV_SPILL: 2, KV_DROP: 3}
        for t in sorted(transfers, key=lambda t: order[t.kind]):
            op = self._ops[t.op_id] = _Op(t)
            if t.kind == KV_STORE:
                self._store(op)
            elif t.kind == KV_LOAD:
                self._load(op)
            elif t.kind == KV_SPILL:
                op.futures = [(i, self.pool.submit(self._write, t.keys[i], t.ram_slots[i], None))
                              for i in range(len(t.keys))]
            else:
                op.futures = [(i, self.pool.submit(self._delete, k))
                              for i, k in enumerate(t.keys)]
        self._pump()

    def _store(self, op: _Op) -> None:
        t = op.op
        ids = to_device(t.block_ids, torch.int64, self.device)
        done = None
        for a in range(0, len(ids), self.chunk):
            payload = self.codec.gather(ids[a : a + self.chunk])  # compute stream
            slots = t.ram_slots[a : a + self.chunk]
            if not self.cuda:
                self.ram.data.index_copy_(0, torch.tensor(slots), payload)
                continue
            gathered = torch.cuda.Event()
            gathered.record()
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(gathered)
                for i, s, n in runs(slots):
                    self.ram.data[s : s + n].copy_(payload[i : i + n], non_blocking=True)
                payload.record_stream(self.d2h)
                done = torch.cuda.Event()
                done.record()
        if done is not None:
            op.events.append(done)
        op.futures = [(i, self.pool.submit(self._write, t.keys[i], t.ram_slots[i], done))
                      for i in range(len(t.keys)) if t.disk[i]]

    def _load(self, op: _Op) -> None:
        t = op.op
        ram = [i for i, d in enumerate(t.disk) if not d]
        if ram:
            self._to_device(op, [t.block_ids[i] for i in ram],
                            self.ram, [t.ram_slots[i] for i in ram])
        for i, d in enumerate(t.disk):
            if d:
                self._read_queue.append((op, i))
                op.reads_left += 1

    def _to_device(self, op: _Op, block_ids: list[int], src: HostBuffer,
                   slots: list[int]) -> None:
        """Copy payloads from host slots into device blocks (an event of the copy joins op)."""
        if not self.cuda:
            payload = src.data.index_select(0, torch.tensor(slots))
            self.codec.scatter(payload, torch.tensor(block_ids))
            return
        ready = torch.cuda.Event()
        ready.record()  # the fresh blocks' last users are behind us on the compute stream
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(ready)
            ids = to_device(block_ids, torch.int64, self.device)
            for a in range(0, len(ids), self.chunk):
                part = slots[a : a + self.chunk]
                buf = torch.empty((len(part), src.payload_bytes), dtype=torch.uint8,
                                  device=self.device)
                for i, s, n in runs(part):
                    buf[i : i + n].copy_(src.data[s : s + n], non_blocking=True)
                self.codec.scatter(buf, ids[a : a + len(part)])
            done = torch.cuda.Event()
            done.record()
        op.events.append(done)

    # ---------------------------------------------------------------- I/O threads

    def _write(self, key: bytes, slot: int, after: Any) -> bool:
        if after is not None:
            after.synchronize()  # the slot's device-to-host copy
        assert self.disk is not None
        return self.disk.write(key, self.ram.view(slot))

    def _delete(self, key: bytes) -> bool:
        assert self.disk is not None
        self.disk.delete(key)
        return True

    # ---------------------------------------------------------------- progress

    def _pump(self) -> None:
        """Start disk reads while staging slots are free; move the finished ones to the
        device; again while that freed slots for reads still queued."""
        while True:
            while self._staging_busy and _ended(self._staging_busy[0][0]):
                self._staging_free += self._staging_busy.popleft()[1]
            while self._read_queue and self._staging_free:
                op, i = self._read_queue.popleft()
                slot = self._staging_free.pop()
                assert self.disk is not None
                fut = self.pool.submit(self.disk.read, op.op.keys[i], self.staging.view(slot))
                self._reading.append((op, i, slot, fut))
            done, reading = [], []
            for r in self._reading:
                (done if r[3].done() else reading).append(r)
            if not done:
                return
            self._reading = reading
            self._move(done)
            if not (self._read_queue and self._staging_free):
                return

    def _move(self, reads: list[tuple[_Op, int, int, cf.Future]]) -> None:
        """Finished disk reads to their device blocks, one batch per transfer."""
        moved: dict[int, tuple[_Op, list[int], list[int]]] = {}
        for op, i, slot, fut in reads:
            op.reads_left -= 1
            if _result(fut):
                entry = moved.setdefault(op.op.op_id, (op, [], []))
                entry[1].append(op.op.block_ids[i])
                entry[2].append(slot)
            else:
                op.failed.add(i)
                self._staging_free.append(slot)
        for op, block_ids, slots in moved.values():
            self._to_device(op, block_ids, self.staging, slots)
            if self.cuda:
                self._staging_busy.append((op.events[-1], slots))
            else:
                self._staging_free += slots

    def _ended(self, op: _Op) -> bool:
        return (not op.reads_left and all(f.done() for _, f in op.futures)
                and all(_ended(e) for e in op.events))

    def poll(self) -> tuple[list[int], dict[int, list[int]]]:
        self._pump()
        finished: list[int] = []
        failed: dict[int, list[int]] = {}
        for op_id, op in list(self._ops.items()):
            if not self._ended(op):
                continue
            del self._ops[op_id]
            op.failed.update(i for i, f in op.futures if not _result(f))
            finished.append(op_id)
            if op.failed:
                failed[op_id] = sorted(op.failed)
        return finished, failed

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._ops:
            self._pump()
            if any(self._ended(op) for op in self._ops.values()):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            io = [f for op in self._ops.values() for _, f in op.futures if not f.done()]
            io += [r[3] for r in self._reading]
            if io:
                cf.wait(io, timeout=min(left, 0.002), return_when=cf.FIRST_COMPLETED)
            else:  # device copies only
                time.sleep(min(left, 0.0002))

    def shutdown(self) -> None:
        if self.pool is None:
            return
        self.pool.shutdown(wait=True)  # writes in flight finish: the disk keeps them
        self.pool = None
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy reads host memory any more
        self.ram.release()
        self.staging.release()


def _ended(event: Any) -> bool:
    return event is None or event.query()


def _result(fut: cf.Future) -> bool:
    try:
        return bool(fut.result())
    except Exception:  # a bug in an I/O task: the block counts as failed, the engine goes on
        log.exception("a KV tier transfer failed")
        return False
