"""The block pool's KV-event log: replayed over the hashes findable before it, it gives exactly
the hashes findable after it, whatever the pool did (a router's index depends on it)."""

from __future__ import annotations

import random

from skyline.cache.block_pool import BlockPool
from skyline.cache.kv_manager import KVCacheManager
from skyline.cache.prefix import hash_block
from skyline.types import KVEventKind, Request, SamplingParams


def replay(state: set[bytes], events: list[tuple[int, list[bytes]]]) -> set[bytes]:
    for kind, hashes in events:
        if kind == KVEventKind.STORED:
            assert not state & set(hashes), "stored twice without a removal"
            state |= set(hashes)
        elif kind == KVEventKind.REMOVED:
            assert set(hashes) <= state, "removed what was not stored"
            state -= set(hashes)
        else:
            assert kind == KVEventKind.CLEARED and not hashes
            state = set()
    return state


def test_no_events_unless_recorded():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, hash_block(b"", [1]))
    assert pool.take_events() == []


def test_random_operations_replay_to_the_cached_set():
    rng = random.Random(0)
    pool = BlockPool(16, record_events=True)
    held: list[list] = []
    state: set[bytes] = set()
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            blocks = pool.get_new_blocks(rng.randint(1, min(3, pool.num_free_blocks)))
            held.append(blocks)
            for b in blocks:
                if rng.random() < 0.7:  # a few hashes recur: duplicates keep no hash
                    pool.cache_full_block(b, hash_block(b"", [rng.randint(0, 40)]))
        elif op < 0.75 and held:
            pool.free_blocks(reversed(held.pop(rng.randrange(len(held)))))
        elif op < 0.9:
            hit = pool.get_cached_block(hash_block(b"", [rng.randint(0, 40)]))
            if hit is not None:
                pool.touch([hit])
                held.append([hit])
        elif op < 0.905:
            pool.reset_prefix_cache()
        if rng.random() < 0.2:
            state = replay(state, pool.take_events())
            assert state == set(pool.cached_hashes()), step
    pool.check_invariants()


def test_manager_publishes_prompt_blocks_in_chain_order():
    mgr = KVCacheManager(8, 4, record_events=True)
    req = Request("a", list(range(10)), SamplingParams())
    assert mgr.allocate_slots(req, 10) is not None
    mgr.cache_blocks(req, 10)
    (kind, hashes), = mgr.block_pool.take_events()
    assert kind == KVEventKind.STORED
    assert hashes == mgr.block_hashes(req)[:2]  # the two full blocks, parent first
