"""The tiers' half of the KV connector on the scheduler's side: device -> host RAM -> disk.

Which tier holds each block hash is in cache/tiers.py; this module decides what moves:
- a prefix the device misses is looked up block by block in RAM, then on disk, and the chain
  of hits (mixed tiers allowed) is loaded into fresh device blocks (`load`);
- policy "eviction" (write-back): a device block is stored to RAM by the step that evicts it
  (the worker gathers it before that step's forward pass can overwrite it, and copies it to
  host memory asynchronously). RAM keeps `ram_headroom` slots free, or being freed, for those
  stores: its least recently used entries are spilled to disk ahead of need and leave RAM once
  written. A block evicted from the last tier is gone;
- policy "eager" (write-through): every block is written to RAM and disk once computed, so an
  eviction from RAM loses nothing.
A tier's copy is entered in its index only when the worker reports the write ended, so a hit
always reads a whole block; a disk write that failed (a full disk) lowers the disk's capacity
to what it holds, and a load that failed drops the blocks it could not read from the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from skyline.cache.connector import KVConnectorScheduler, LoadEnded
from skyline.cache.prefix import BlockHash
from skyline.cache.tiers import VICTIM_SCAN, DiskTier, RamTier
from skyline.types import KV_DROP, KV_LOAD, KV_SPILL, KV_STORE, KVTransfer, Request


@dataclass(frozen=True)
class TierLayout:
    """What the workers hold (worker/connector/tiers.py, merged over ranks): RAM slots, disk
    capacity in blocks (-1: no disk tier), whether the disk can be written, the blocks found
    on disk at start-up (oldest first), and whether RAM is only the disk's write buffer (no
    RAM tier was asked for): then every block stored to RAM goes on to disk at once."""

    ram_slots: int
    disk_blocks: int = -1
    disk_writable: bool = True
    disk_found: tuple[BlockHash, ...] = ()
    ram_is_buffer: bool = False


class TierConnector(KVConnectorScheduler):
    def __init__(self, layout: TierLayout, block_size: int, eager: bool,
                 ram_headroom: int) -> None:
        self.block_size = block_size
        self.eager = eager
        self.ram_headroom = ram_headroom
        self.ram = RamTier(layout.ram_slots)
        self.ram_is_buffer = layout.ram_is_buffer
        self.disk = (DiskTier(layout.disk_blocks, layout.disk_writable, layout.disk_found)
                     if layout.disk_blocks >= 0 else None)
        self._ops: dict[int, KVTransfer] = {}
        self._next_op = 0
        self._loads: list[KVTransfer] = []  # planned this step
        self._to_store: dict[BlockHash, int] = {}  # -> device block id, this step
        self._storing: set[BlockHash] = set()  # stores in flight
        self._spilling: set[BlockHash] = set()  # RAM -> disk in flight
        self._dropping: set[BlockHash] = set()  # disk files being deleted
        self._to_drop: list[BlockHash] = []
        self._to_spill: list[BlockHash] = []  # stored to a RAM write buffer: on to disk
        # Entries that must not be read (a reset, a failed load), removed once unpinned; and
        # writes in flight at a reset, whose blocks are not entered.
        self._forget: set[BlockHash] = set()
        self._stale: set[BlockHash] = set()
        self.counts = dict.fromkeys(
            ("ram_hit_tokens", "disk_hit_tokens", "ram_stored_blocks", "disk_stored_blocks",
             "ram_evicted_blocks", "disk_evicted_blocks", "load_failed_blocks",
             "store_failed_blocks"), 0)

    # ---------------------------------------------------------------- what is below

    def _held(self, h: BlockHash) -> bool:
        """A copy of `h` exists below the device, or is being made."""
        return h in self._storing or (self._findable(h))

    def _findable(self, h: BlockHash) -> bool:
        return (h in self.ram or (self.disk is not None and h in self.disk)) \
            and h not in self._forget

    def _on_disk(self, h: BlockHash) -> bool:
        """A RAM entry with a copy on disk (or one being written): evicting it loses nothing."""
        return self.disk is not None and (h in self.disk or h in self._spilling)

    def num_matched_blocks(self, request: Request, hashes: Sequence[BlockHash], start: int,
                           stop: int) -> int:
        n = 0
        while start + n < stop and self._findable(hashes[start + n]):
            n += 1
        return n

    # ---------------------------------------------------------------- this step

    def load(self, request: Request, hashes: Sequence[BlockHash],
             block_ids: Sequence[int]) -> int:
        slots, disk = [], []
        for h in hashes:
            tier = self.ram if h in self.ram else self.disk
            assert tier is not None and h in tier
            slot = tier.pin(h)
            tier.touch(h)
            slots.append(slot if tier is self.ram else -1)
            disk.append(tier is not self.ram)
        op = self._new(KV_LOAD, list(hashes), list(block_ids), slots, disk)
        op.request_id = request.request_id
        self._loads.append(op)
        return op.op_id

    def block_cached(self, block_id: int, block_hash: BlockHash) -> None:
        if self.eager and not self._held(block_hash):
            self._to_store[block_hash] = block_id

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        if not self._held(block_hash):
            self._to_store[block_hash] = block_id

    def build(self) -> list[KVTransfer]:
        out = [op for op in (self._store(), self._clean()) if op is not None]
        if self.disk is not None:
            self._drop(self.disk.trim())
        if self._to_drop:
            out.append(self._new(KV_DROP, self._to_drop))
            self._dropping.update(self._to_drop)
            self._to_drop = []
        out += self._loads
        self._loads = []
        return out

    def _store(self) -> KVTransfer | None:
        """Device blocks to RAM (and, eagerly, to disk)."""
        keys, ids, slots, disk = [], [], [], []
        for h, block_id in self._to_store.items():
            got = self.ram.take(self._on_disk)
            if got is None:  # every RAM entry is being read
                continue
            slot, evicted, _ = got
            if evicted is not None:
                self._evicted_from_ram(evicted)
            keys.append(h)
            ids.append(block_id)
            slots.append(slot)
            disk.append(self.eager and self._reserve_disk(h))
            self._storing.add(h)
        self._to_store.clear()
        return self._new(KV_STORE, keys, ids, slots, disk) if keys else None

    def _clean(self) -> KVTransfer | None:
        """Keep up to `ram_headroom` RAM slots free or being freed (write-back): the least
        recently used entries leave RAM, those without a disk copy once spilled to disk. A
        RAM write buffer spills everything stored to it."""
        if self.disk is None or self.eager:
            return None
        keys: list[BlockHash] = []
        slots: list[int] = []

        def spill(h: BlockHash) -> bool:
            if h in self.disk or h in self._spilling or h in self._forget \
                    or not self._reserve_disk(h):
                return False
            keys.append(h)
            slots.append(self.ram.pin(h))
            self._spilling.add(h)
            return True

        for h in self._to_spill:
            if h in self.ram:
                spill(h)
        self._to_spill = []
        need = min(self.ram_headroom, self.ram.capacity // 4) - len(self.ram.free) \
            - len(self._spilling)
        for h in self.ram.oldest(need + VICTIM_SCAN) if need > 0 else ():
            if need <= 0:
                break
            if h in self.ram.pins:
                continue
            if h in self.disk:
                self.ram.release(self.ram.remove(h))
                self._evicted_from_ram(h)
                need -= 1
            elif spill(h):
                need -= 1
        return self._new(KV_SPILL, keys, [], slots, [True] * len(keys)) if keys else None

    def _reserve_disk(self, h: BlockHash) -> bool:
        if self.disk is None or h in self.disk or h in self._dropping:
            return False
        evicted = self.disk.reserve(lambda _: True)
        if evicted is None:
            return False
        self._drop(evicted)
        return True

    def _evicted_from_ram(self, h: BlockHash) -> None:
        self.counts["ram_evicted_blocks"] += 1

    def _drop(self, hashes: list[BlockHash]) -> None:
        self.counts["disk_evicted_blocks"] += len(hashes)
        self._to_drop += hashes

    def _new(self, kind: str, keys: list[BlockHash], block_ids: list[int] | None = None,
             slots: list[int] | None = None, disk: list[bool] | None = None) -> KVTransfer:
        op = KVTransfer(self._next_op, kind, keys, block_ids or [], slots or [], disk or [])
        self._next_op += 1
        self._ops[op.op_id] = op
        return op

    # ---------------------------------------------------------------- the worker's report

    def update(self, finished: Sequence[int], failed: dict[int, list[int]]) -> list[LoadEnded]:
        ended = []
        for op_id in finished:
            op = self._ops.pop(op_id, None)
            if op is None:
                continue
            bad = set(failed.get(op_id, ()))
            if op.kind == KV_LOAD:
                ended.append(LoadEnded(op_id, self._loaded(op, bad)))
            elif op.kind == KV_STORE:
                self._stored(op, bad)
            elif op.kind == KV_SPILL:
                for i, h in enumerate(op.keys):
                    self._spilling.discard(h)
                    self._disk_written(h, i not in bad)
                    self._unpin(self.ram, h)
            else:
                self._dropping.difference_update(op.keys)
        return ended

    def _loaded(self, op: KVTransfer, bad: set[int]) -> int:
        first_bad = min(bad, default=len(op.keys))
        for i, (h, from_disk) in enumerate(zip(op.keys, op.disk, strict=True)):
            tier = self.disk if from_disk else self.ram
            assert tier is not None
            if i < first_bad:
                self.counts[f"{tier.name}_hit_tokens"] += self.block_size
            if i in bad:  # missing or corrupt: never tried again
                self._forget.add(h)
            self._unpin(tier, h)
        self.counts["load_failed_blocks"] += len(bad)
        return first_bad

    def _stored(self, op: KVTransfer, bad: set[int]) -> None:
        for i, (h, slot, to_disk) in enumerate(zip(op.keys, op.ram_slots, op.disk,
                                                   strict=True)):
            self._storing.discard(h)
            if h in self._stale:  # computed before a reset
                self.ram.num_reserved -= 1
                self.ram.release(slot)
            else:
                self.ram.fill(h, slot)
                self.counts["ram_stored_blocks"] += 1
                if self.ram_is_buffer and self.disk is not None and not self.eager:
                    self._to_spill.append(h)
            if to_disk:
                self._disk_written(h, i not in bad)
            else:
                self._stale.discard(h)

    def _disk_written(self, h: BlockHash, ok: bool) -> None:
        """A write to disk ended (the last step of a store or a spill of `h`)."""
        assert self.disk is not None
        self.disk.num_reserved -= 1
        if h in self._stale:  # computed before a reset: delete it
            self._stale.discard(h)
            self._drop([h])
        elif ok:
            self.disk.add(h)
            self.counts["disk_stored_blocks"] += 1
        else:  # a full disk (or a failing one): hold no more than now
            self.counts["store_failed_blocks"] += 1
            self.disk.capacity = len(self.disk) + self.disk.num_reserved

    def _unpin(self, tier: RamTier | DiskTier, h: BlockHash) -> None:
        if h not in tier.pins:
            return
        tier.unpin(h)
        if h in self._forget and h not in tier.pins and h in tier:
            self._forget.discard(h)
            location = tier.remove(h)
            if tier is self.ram:
                self.ram.release(location)
            else:
                self._drop([h])

    # ---------------------------------------------------------------- queries

    @property
    def num_in_flight(self) -> int:
        """Transfers started, and blocks waiting for the next `build` to start theirs."""
        return len(self._ops) + len(self._to_store) + len(self._to_spill) + len(self._to_drop)

    def reset(self) -> int:
        self._stale = self._storing | self._spilling
        n = 0
        for tier in (self.ram, self.disk):
            if tier is None:
                continue
            for h in list(tier.entries):
                n += 1
                if h in tier.pins:
                    self._forget.add(h)
                elif tier is self.ram:
                    self.ram.release(self.ram.remove(h))
                else:
                    tier.remove(h)
                    self._drop([h])
        return n

    def stats(self) -> dict[str, float]:
        s = {f"kv_offload_{k}": float(v) for k, v in self.counts.items()}
        for tier in (self.ram, self.disk):
            if tier is not None:
                s[f"kv_offload_{tier.name}_blocks"] = len(tier)
                s[f"kv_offload_{tier.name}_capacity_blocks"] = tier.capacity
                s[f"kv_offload_{tier.name}_usage"] = tier.usage
        s["kv_offload_transfers_in_flight"] = len(self._ops)
        return s

    def check_invariants(self) -> None:
        """Tier invariants, and once nothing is in flight, nothing pinned or reserved."""
        self.ram.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()
        if not self._ops and not self._loads:
            assert not self.ram.pins and not self.ram.num_reserved
            assert self.disk is None or (not self.disk.pins and not self.disk.num_reserved)
            assert not self._storing and not self._spilling and not self._dropping
