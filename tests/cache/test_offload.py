"""The tiers' scheduler half (cache/offload.py, cache/tiers.py) against hand-made worker
reports: what is stored, loaded, spilled and dropped, and what a failure does to the index."""

from __future__ import annotations

import pytest

from skyline.cache.offload import TierConnector, TierLayout
from skyline.cache.prefix import hash_block
from skyline.cache.tiers import DiskTier, RamTier
from skyline.types import KV_DROP, KV_LOAD, KV_SPILL, KV_STORE, Request, SamplingParams

BS = 4


def h(i: int) -> bytes:
    return hash_block(b"", [i])


def req(rid: str = "r") -> Request:
    return Request(rid, [1, 2, 3], SamplingParams())


def connector(ram: int = 8, disk: int = -1, eager: bool = False, headroom: int = 0,
              writable: bool = True, found: tuple[bytes, ...] = (),
              buffer: bool = False) -> TierConnector:
    return TierConnector(TierLayout(ram, disk, writable, found, buffer), BS, eager, headroom)


def finish(c: TierConnector, ops, failed=None):
    ended = c.update([op.op_id for op in ops], failed or {})
    c.check_invariants()
    return ended


def store(c: TierConnector, *items: tuple[int, bytes]):
    for block_id, key in items:
        c.block_evicted(block_id, key)
    ops = c.build()
    finish(c, ops)
    return ops


def test_evicted_block_is_stored_once_then_found():
    c = connector()
    c.block_evicted(5, h(1))
    (op,) = c.build()
    assert (op.kind, op.block_ids, op.keys, op.disk) == (KV_STORE, [5], [h(1)], [False])
    c.block_evicted(6, h(1))  # a second copy while the first is in flight: not stored again
    assert c.build() == []
    assert c.num_matched_blocks(req(), [h(1)], 0, 1) == 0  # entered only once written
    finish(c, [op])
    assert c.num_matched_blocks(req(), [h(1), h(2)], 0, 2) == 1
    c.block_evicted(7, h(1))  # already below: nothing to do
    assert c.build() == []
    assert c.stats()["kv_offload_ram_stored_blocks"] == 1


def test_load_pins_ram_entries_against_eviction():
    c = connector(ram=2)
    store(c, (0, h(1)), (1, h(2)))
    lid = c.load(req(), [h(1), h(2)], [7, 8])
    (load,) = c.build()
    assert (load.op_id, load.kind, load.block_ids, load.disk) == (lid, KV_LOAD, [7, 8],
                                                                  [False, False])
    assert sorted(load.ram_slots) == [0, 1]
    c.block_evicted(3, h(3))  # RAM is full of pinned entries: nothing to evict for it
    assert c.build() == []
    (ended,) = finish(c, [load])
    assert ended.num_blocks == 2 and c.counts["ram_hit_tokens"] == 2 * BS
    store(c, (3, h(3)))  # unpinned now: the least recently used one makes room
    assert c.num_matched_blocks(req(), [h(3)], 0, 1) == 1
    assert c.counts["ram_evicted_blocks"] == 1


def test_failed_disk_read_recomputes_from_there_and_forgets_the_block():
    c = connector(ram=1, disk=8, found=(h(1), h(2), h(3)))
    assert c.num_matched_blocks(req(), [h(1), h(2), h(3), h(4)], 0, 4) == 3
    c.load(req(), [h(1), h(2), h(3)], [4, 5, 6])
    (load,) = c.build()
    assert load.disk == [True] * 3 and load.ram_slots == [-1] * 3
    (ended,) = finish(c, [load], {load.op_id: [1]})
    assert ended.num_blocks == 1  # block 0 arrived; block 1 failed, so block 2 is not used
    assert c.counts["disk_hit_tokens"] == BS and c.counts["load_failed_blocks"] == 1
    assert c.num_matched_blocks(req(), [h(1), h(2), h(3)], 0, 3) == 1
    assert c.num_matched_blocks(req(), [h(3)], 0, 1) == 1
    (drop,) = c.build()  # the damaged block's file goes
    assert drop.kind == KV_DROP and drop.keys == [h(2)]


def test_eager_writes_every_computed_block_to_ram_and_disk():
    c = connector(ram=2, disk=8, eager=True)
    c.block_cached(0, h(1))
    c.block_cached(1, h(2))
    (op,) = c.build()
    assert op.kind == KV_STORE and op.disk == [True, True]
    finish(c, [op])
    assert c.disk is not None and len(c.disk) == 2
    store(c, (2, h(3)))  # evicts a RAM entry with a disk copy: nothing is lost
    assert c.num_matched_blocks(req(), [h(1), h(2), h(3)], 0, 3) == 3


def test_write_back_spills_old_ram_entries_then_frees_their_slots():
    c = connector(ram=8, disk=8, headroom=2)
    seen = []
    for i in range(10):
        if i < 8:
            c.block_evicted(i, h(i))
        ops = c.build()
        seen += ops
        finish(c, ops)
    spills = [op for op in seen if op.kind == KV_SPILL]
    assert [k for op in spills for k in op.keys] == [h(0), h(1)]
    assert all(op.block_ids == [] and op.disk == [True] for op in spills)
    # written, they left RAM: two slots are free for the next evictions
    assert len(c.ram.free) == 2 and c.disk is not None and list(c.disk.entries) == [h(0), h(1)]
    c.load(req(), [h(0), h(1), h(2)], [0, 1, 2])  # mixed tiers, one transfer
    (load,) = c.build()
    assert load.disk == [True, True, False]
    finish(c, [load])


def test_a_ram_write_buffer_spills_everything_to_disk():
    c = connector(ram=64, disk=8, buffer=True)
    store(c, (0, h(0)), (1, h(1)))
    (spill,) = c.build()
    assert spill.kind == KV_SPILL and spill.keys == [h(0), h(1)]
    finish(c, [spill])
    assert c.disk is not None and list(c.disk.entries) == [h(0), h(1)]
    assert len(c.ram) == 2  # and RAM keeps them while it has room


def test_full_disk_lowers_the_capacity_and_evicts_for_room():
    c = connector(ram=4, disk=100, eager=True)
    c.block_cached(0, h(0))
    c.block_cached(1, h(1))
    (op,) = c.build()
    finish(c, [op], {op.op_id: [1]})  # the second file did not fit
    assert c.disk is not None and c.disk.capacity == 1 and len(c.disk) == 1
    assert c.counts["store_failed_blocks"] == 1
    c.block_cached(2, h(2))
    ops = c.build()
    assert [o.kind for o in ops] == [KV_STORE, KV_DROP] and ops[1].keys == [h(0)]
    finish(c, ops)
    assert h(2) in c.disk and h(0) not in c.disk


def test_restart_found_blocks_beyond_capacity_are_trimmed_oldest_first():
    c = connector(ram=2, disk=2, found=(h(0), h(1), h(2)))
    (drop,) = c.build()
    assert drop.kind == KV_DROP and drop.keys == [h(0)]
    finish(c, [drop])
    assert c.num_matched_blocks(req(), [h(1), h(2)], 0, 2) == 2


def test_read_only_disk_is_read_never_written():
    c = connector(ram=1, disk=4, eager=True, writable=False, found=(h(0),))
    assert c.num_matched_blocks(req(), [h(0)], 0, 1) == 1
    c.block_cached(1, h(1))
    (op,) = c.build()
    assert op.disk == [False]
    finish(c, [op])
    assert c.build() == []


def test_reset_forgets_everything_even_what_is_in_flight():
    c = connector(ram=4, disk=4, eager=True)
    store(c, (0, h(0)))
    c.load(req(), [h(0)], [5])
    c.block_cached(1, h(1))
    ops = c.build()
    assert c.reset() == 2
    assert c.num_matched_blocks(req(), [h(0)], 0, 1) == 0
    finish(c, ops)  # the load ends (its entry goes), the store's block is not entered
    assert len(c.ram) == 0 and c.disk is not None and len(c.disk) == 0
    drops = c.build()
    assert {k for op in drops for k in op.keys} == {h(0), h(1)}
    finish(c, drops)


def test_ram_tier_slots_partition_and_victims():
    ram = RamTier(2)
    a, b = ram.take(lambda _: False), ram.take(lambda _: False)
    assert a is not None and b is not None and {a[0], b[0]} == {0, 1}
    ram.fill(h(0), a[0])
    ram.fill(h(1), b[0])
    ram.pin(h(0))
    got = ram.take(lambda k: k == h(0))  # the clean one is pinned: the dirty one goes
    assert got == (b[0], h(1), False)
    ram.release(got[0])
    ram.num_reserved -= 1
    ram.unpin(h(0))
    ram.check_invariants()


def test_disk_tier_reserve_puts_back_what_it_cannot_use():
    disk = DiskTier(2, True, [h(0), h(1)])
    disk.pin(h(0))
    disk.pin(h(1))
    assert disk.reserve(lambda _: True) is None
    assert list(disk.entries) == [h(0), h(1)]


@pytest.mark.parametrize("eager", [False, True])
def test_no_disk_tier_means_ram_only(eager):
    c = connector(ram=1, eager=eager)
    store(c, (0, h(0)))
    store(c, (1, h(1)))  # one slot: the second store evicts the first
    assert c.num_matched_blocks(req(), [h(0)], 0, 1) == 0
    assert c.num_matched_blocks(req(), [h(1)], 0, 1) == 1
