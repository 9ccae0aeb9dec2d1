"""Which tier beyond the device holds each block hash: host RAM and disk.

Pure bookkeeping, the same on every rank: the worker of each rank keeps its own shard of every
block in the same RAM slot (one pinned buffer of `num_slots` blocks per rank) and in its own
file per block on disk. Each tier is LRU. An entry is *pinned* while a transfer reads it (a
load into the device, or a RAM slot's spill to disk); pinned entries are never evicted. A RAM
slot is in one state at a time: free, reserved (a store into it is in flight), or holding an
entry. Disk room is counted in blocks: entries plus writes in flight.

Invariants (checked by `check_invariants`, which tests call):
- RAM: free slots, reserved slots and the entries' slots partition range(num_slots);
- a tier never holds more than its capacity (entries plus reservations), except that a disk
  found fuller than its capacity at start-up is trimmed by the next transfers;
- every pin belongs to an entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from skyline.cache.prefix import BlockHash

# Least recently used entries looked at for one that is evictable (unpinned and clean), before
# an unpinned dirty one is dropped instead: a bounded cost per block.
VICTIM_SCAN = 32


class Tier:
    """One tier's index: block hash -> location (a RAM slot; 0 on disk), least recently used
    first."""

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.entries: OrderedDict[BlockHash, int] = OrderedDict()
        self.pins: dict[BlockHash, int] = {}
        self.num_reserved = 0  # room taken by writes in flight

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def usage(self) -> float:
        return (len(self.entries) + self.num_reserved) / self.capacity if self.capacity else 0.0

    def touch(self, block_hash: BlockHash) -> None:
        self.entries.move_to_end(block_hash)

    def pin(self, block_hash: BlockHash) -> int:
        """Keep the entry until `unpin`; returns its location."""
        self.pins[block_hash] = self.pins.get(block_hash, 0) + 1
        return self.entries[block_hash]

    def unpin(self, block_hash: BlockHash) -> None:
        n = self.pins.pop(block_hash) - 1
        if n:
            self.pins[block_hash] = n

    def add(self, block_hash: BlockHash, location: int = 0) -> None:
        self.entries[block_hash] = location
        self.entries.move_to_end(block_hash)

    def remove(self, block_hash: BlockHash) -> int:
        assert block_hash not in self.pins, "removing a pinned entry"
        return self.entries.pop(block_hash)

    def oldest(self, n: int) -> Iterator[BlockHash]:
        """The `n` least recently used hashes (a snapshot: the caller may change the tier)."""
        return iter([h for h, _ in zip(self.entries, range(n), strict=False)])

    def victim(self, clean: Callable[[BlockHash], bool]) -> tuple[BlockHash, bool] | None:
        """The entry to evict for room: the least recently used unpinned one that is `clean`
        (a copy exists below), else the least recently used unpinned one; with whether it is
        clean. None when every entry looked at is pinned."""
        first = None
        for i, h in enumerate(self.entries):
            if h in self.pins:
                continue
            if clean(h):
                return h, True
            if first is None:
                first = h
            if i >= VICTIM_SCAN:
                break
        return None if first is None else (first, False)


class RamTier(Tier):
    """Host RAM: `capacity` numbered slots."""

    def __init__(self, num_slots: int) -> None:
        super().__init__("ram", num_slots)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives 0, 1, 2, ...

    def take(self, clean: Callable[[BlockHash], bool]) -> tuple[int, BlockHash | None,
                                                                  bool] | None:
        """Reserve a slot for a new block: a free one, else the slot of an evicted entry.
        Returns (slot, evicted hash or None, whether the evicted entry was clean), or None."""
        if self.free:
            self.num_reserved += 1
            return self.free.pop(), None, True
        found = self.victim(clean)
        if found is None:
            return None
        h, was_clean = found
        self.num_reserved += 1
        return self.remove(h), h, was_clean

    def release(self, slot: int) -> None:
        """A reserved slot whose store ended without an entry (or a removed entry's slot)."""
        self.free.append(slot)

    def fill(self, block_hash: BlockHash, slot: int) -> None:
        """A reserved slot's store ended: it holds `block_hash` now."""
        self.num_reserved -= 1
        if block_hash in self.entries:  # stored twice meanwhile (a reset forgot it): keep one
            self.release(slot)
        else:
            self.add(block_hash, slot)

    def check_invariants(self) -> None:
        slots = list(self.entries.values()) + self.free
        assert len(set(slots)) == len(slots), "a RAM slot in two places"
        assert len(slots) + self.num_reserved == self.capacity, (len(slots), self.num_reserved)
        assert set(self.pins) <= set(self.entries)


class DiskTier(Tier):
    """A directory: one file per block (and rank). `writable` False: read what is there, write
    nothing (a read-only directory)."""

    def __init__(self, capacity: int, writable: bool, found: Iterable[BlockHash]) -> None:
        super().__init__("disk", capacity)
        self.writable = writable
        for h in found:  # oldest first
            self.add(h)

    def reserve(self, clean: Callable[[BlockHash], bool]) -> list[BlockHash] | None:
        """Room for one more file: the hashes evicted to make it (their files to delete), or
        None if there is none to make."""
        if not self.writable:
            return None
        evicted: list[BlockHash] = []
        while len(self.entries) + self.num_reserved >= self.capacity:
            found = self.victim(clean)
            if found is None:
                for h in reversed(evicted):  # no room to make: put them back where they were
                    self.add(h)
                    self.entries.move_to_end(h, last=False)
                return None
            self.remove(found[0])
            evicted.append(found[0])
        self.num_reserved += 1
        return evicted

    def trim(self) -> list[BlockHash]:
        """Entries beyond the capacity (a disk found fuller at start-up, or a capacity lowered
        after a full disk), least recently used first: their files are to be deleted."""
        out = []
        if not self.writable:
            return out
        while len(self.entries) + self.num_reserved > self.capacity:
            found = self.victim(lambda h: True)
            if found is None:
                break
            self.remove(found[0])
            out.append(found[0])
        return out

    def check_invariants(self) -> None:
        assert set(self.pins) <= set(self.entries)
        assert self.num_reserved >= 0
