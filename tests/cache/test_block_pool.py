from __future__ import annotations

import pytest

from skyline.cache.block_pool import BlockPool
from skyline.cache.prefix import hash_block


def h(i: int) -> bytes:
    return hash_block(b"", [i])


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool._free)


def test_allocate_free_counts_and_usage():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    a = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.free_blocks(reversed(a))
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    pool.check_invariants()


def test_lru_order_hashed_blocks_evicted_oldest_first():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    for blk, i in zip(a + b, range(4), strict=True):
        pool.cache_full_block(blk, h(i))
    pool.free_blocks(reversed(a))  # a's tail first
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [a[1].block_id, a[0].block_id, b[1].block_id, b[0].block_id]
    # Reallocation takes from the head and drops the hash of what it evicts.
    (x,) = pool.get_new_blocks(1)
    assert x is a[1] and x.block_hash is None and pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) is a[0]  # still findable while free
    pool.check_invariants()


def test_unhashed_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    cached, private = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_block(cached[0], h(7))
    pool.free_blocks(cached)
    pool.free_blocks(private)
    (x,) = pool.get_new_blocks(1)
    assert x is private[0]
    assert pool.get_cached_block(h(7)) is cached[0]


def test_touch_revives_free_cached_block_and_shares_used_one():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_full_block(blk, h(1))
    pool.touch([blk])  # shared by a second request
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 3
    pool.touch([pool.get_cached_block(h(1))])  # revived from the free queue (middle removal)
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 2 and blk.block_id not in pool._free
    pool.check_invariants()
    with pytest.raises(AssertionError):
        pool.free_blocks([blk, blk])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(5))
    pool.cache_full_block(b, h(5))
    assert pool.get_cached_block(h(5)) is a and b.block_hash is None
    pool.check_invariants()


def test_caching_disabled_and_reset():
    off = BlockPool(2, enable_caching=False)
    (blk,) = off.get_new_blocks(1)
    off.cache_full_block(blk, h(1))
    assert off.get_cached_block(h(1)) is None

    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(1))
    pool.cache_full_block(b, h(2))
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(h(1)) is None and a.block_hash is None
    assert a.ref_cnt == 1  # still held by its request
    pool.check_invariants()
