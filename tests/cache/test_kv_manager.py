from __future__ import annotations

from skyline.cache.kv_manager import KVCacheManager
from skyline.types import Request, SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, r: Request, budget: int = 10_000) -> tuple[list[int], int] | None:
    """Admit like the scheduler does, compute the whole prompt, register its blocks."""
    hits, num_hit = kv.get_computed_blocks(r)
    n = min(r.num_tokens - num_hit, budget)
    ids = kv.allocate_slots(r, n, hits)
    if ids is None:
        return None
    r.num_computed_tokens = num_hit + n
    kv.cache_blocks(r, r.num_computed_tokens)
    return ids, num_hit


SYSTEM = list(range(100, 112))  # 3 full blocks


def test_shared_system_prompt_hits():
    kv = KVCacheManager(16, BS)
    a = req("a", SYSTEM + [1, 2, 3])
    b = req("b", SYSTEM + [7, 8, 9, 10, 11])
    ids_a, hit_a = admit(kv, a)
    assert hit_a == 0 and len(ids_a) == 4
    ids_b, hit_b = admit(kv, b)
    assert hit_b == 12
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]  # shared
    assert kv.block_ids("b")[3:] != kv.block_ids("a")[3:]
    assert [blk.ref_cnt for blk in kv.blocks("a")[:3]] == [2, 2, 2]
    assert kv.prefix_queries == 15 + 17 and kv.prefix_hits == 12
    assert abs(kv.hit_rate - 12 / 32) < 1e-9


def test_never_the_whole_prompt():
    kv = KVCacheManager(16, BS)
    admit(kv, req("a", SYSTEM))
    # Same 12 tokens: all 3 blocks are cached, but one token must be computed for logits.
    b = req("b", SYSTEM)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and len(hits) == 2
    # 13 tokens: 12 may be reused, 1 computed.
    c = req("c", SYSTEM + [5])
    assert kv.get_computed_blocks(c)[1] == 12


def test_hits_survive_free_until_evicted():
    kv = KVCacheManager(6, BS)
    a = req("a", SYSTEM + [1])
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 6
    assert kv.get_computed_blocks(req("b", SYSTEM + [2]))[1] == 12
    # A 6-block request evicts everything (the private tail block first).
    admit(kv, req("big", list(range(1000, 1024))))
    assert kv.get_computed_blocks(req("c", SYSTEM + [2]))[1] == 0


def test_touched_hits_are_not_counted_as_free():
    kv = KVCacheManager(4, BS)
    a = req("a", SYSTEM + [1, 2, 3, 4])  # exactly 4 blocks
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4  # all evictable
    # b reuses 3 cached blocks and needs 2 fresh ones: only 1 is free once the hits are taken.
    b = req("b", SYSTEM + list(range(50, 58)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert kv.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in hits)  # nothing changed
    assert kv.prefix_queries == 16 and kv.prefix_hits == 0  # failed attempt not counted
    kv.block_pool.check_invariants()
    # With a budget of one block it fits, and the lookup is counted once.
    ids = kv.allocate_slots(b, 4, hits)
    assert ids is not None and ids[:3] == [blk.block_id for blk in hits] and len(ids) == 4
    assert kv.prefix_queries == 16 + 20 and kv.prefix_hits == 12


def test_chunked_allocation_and_incremental_caching():
    kv = KVCacheManager(8, BS)
    r = req("r", list(range(10)))
    assert kv.allocate_slots(r, 6) is not None  # chunk 1: tokens 0..5 -> 2 blocks
    assert len(kv.block_ids("r")) == 2
    r.num_computed_tokens = 6
    kv.cache_blocks(r, 6)  # only block 0 is full
    assert kv.block_pool.num_cached_blocks == 1
    new = kv.allocate_slots(r, 4)  # chunk 2: tokens 6..9 -> 3 blocks in all
    assert len(new) == 1 and len(kv.block_ids("r")) == 3
    r.num_computed_tokens = 10
    kv.cache_blocks(r, 10)
    assert kv.block_pool.num_cached_blocks == 2
    r.append_output_token(42)
    r.append_output_token(43)  # 12 tokens, but only 10 computed: block 2 not cached yet
    kv.cache_blocks(r, r.num_computed_tokens)
    assert kv.block_pool.num_cached_blocks == 2
    assert kv.allocate_slots(r, 1) == []  # decode of token 10 fits in block 2
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_caching_disabled():
    kv = KVCacheManager(8, BS, enable_caching=False)
    admit(kv, req("a", SYSTEM + [1]))
    assert kv.get_computed_blocks(req("b", SYSTEM + [1]))[1] == 0
    assert kv.block_pool.num_cached_blocks == 0 and kv.prefix_queries == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(8, BS)
    a = req("a", SYSTEM + [1])
    admit(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 3
    assert kv.get_computed_blocks(req("b", SYSTEM + [1]))[1] == 0
    kv.block_pool.check_invariants()


def test_free_evicts_tail_blocks_first():
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(16)) + [99])
    kv.allocate_slots(a, 12)  # 3 blocks, all full and computed
    a.num_computed_tokens = 12
    kv.cache_blocks(a, 12)
    ids = kv.block_ids("a")
    kv.free(a)
    # The unhashed spare block goes first, then a's tail, its prefix last.
    assert list(kv.block_pool._free)[1:] == ids[::-1]
    kv.allocate_slots(req("b", list(range(50, 58))), 8)  # evicts the spare and a's last block
    assert kv.get_computed_blocks(req("c", list(range(16)) + [1]))[1] == 8
