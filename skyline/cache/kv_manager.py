"""Per-request block tables on top of the block pool, with prefix reuse.

A request's blocks cover its first `num_computed_tokens` (+ the tokens scheduled this step)
token slots, in order: block i holds tokens [i * block_size, (i + 1) * block_size). Its leading
blocks may be shared with other requests through the prefix cache; shared blocks are always
full and computed, so nobody writes into them.
"""

from __future__ import annotations

from collections.abc import Sequence

from skyline.cache.block_pool import BlockListener, BlockPool, KVCacheBlock
from skyline.cache.prefix import BlockHash, extend_block_hashes
from skyline.types import Request


class KVCacheManager:
    """Allocates, shares and frees the KV-cache blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 listener: BlockListener | None = None,
                 record_events: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, listener, record_events)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # Hashes of the request's full blocks of *tokens* (computed or not), extended as tokens
        # arrive; dropped by `free` (a preempted request re-hashes once when it resumes).
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of the request are already registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up at admission
        self.prefix_hits = 0  # of which found in the cache

    # ---------------------------------------------------------------- queries

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the prefix cache (0 before any lookup)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self._blocks.get(request_id, [])

    def num_held_blocks(self) -> int:
        """Block references held by all requests (a shared block counts once per holder)."""
        return sum(len(b) for b in self._blocks.values())

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks of tokens, computed or not."""
        hashes = self._hashes.setdefault(request.request_id, [])
        extend_block_hashes(hashes, request.all_token_ids, self.block_size)
        return hashes

    # ---------------------------------------------------------------- lookup and allocation

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached blocks that prefixes the request's tokens, and the number
        of tokens they hold. Never the whole sequence: at least one token must be computed to
        yield logits, so at most `num_tokens - 1` tokens (rounded down to a block) are reused.
        Pure lookup: takes no references and records no stats (see `allocate_slots`)."""
        if not self.enable_caching or request.request_id in self._blocks:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        reserve: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and after
        `new_computed_blocks`, the prefix hits of a request being admitted).

        Returns the ids of the blocks appended to the request's table (hits first, then fresh
        blocks), or None if the pool cannot supply them and leave `reserve` blocks free — then
        nothing has changed. Evictable cached blocks count as free, except the hits themselves,
        which this call revives."""
        rid = request.request_id
        held = self._blocks.get(rid)
        num_tokens = (
            request.num_computed_tokens
            + len(new_computed_blocks) * self.block_size
            + num_new_tokens
        )
        num_required = -(-num_tokens // self.block_size)
        if held and num_required <= len(held):
            return []  # most decode steps: the tail block has room
        if new_computed_blocks:
            assert not held and request.num_computed_tokens == 0, "prefix hits only at admission"
        num_held = len(held) if held else 0
        num_fresh = max(0, num_required - num_held - len(new_computed_blocks))
        # Hits with ref_cnt 0 sit in the free queue: touching them removes them from it.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_fresh + num_revived + reserve > self.block_pool.num_free_blocks:
            return None

        if held is None:
            held = self._blocks[rid] = []
            # Count the lookup once per admission, on success, so a request that waits for
            # blocks over several steps is not counted once per attempt.
            if self.enable_caching:
                self.prefix_queries += request.num_tokens
                self.prefix_hits += len(new_computed_blocks) * self.block_size
        self.block_pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        fresh = self.block_pool.get_new_blocks(num_fresh)
        held.extend(fresh)
        if new_computed_blocks:
            self._num_cached[rid] = len(new_computed_blocks)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in fresh]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_computed_tokens`
        tokens. Call only once the runner has written their KV, so a hit never reads a block
        still being computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        if num_computed_tokens // self.block_size <= start:
            return  # most steps: no block filled up
        held = self._blocks.get(rid)
        if not held:
            return
        num_full = min(num_computed_tokens // self.block_size, len(held))
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(held[i], hashes[i])
        self._num_cached[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the request's tail blocks beyond those that hold its first `num_tokens` token
        slots (slots of rejected draft tokens). Returns how many blocks were freed. The freed
        blocks were never full and computed, so none of them is in the prefix cache."""
        held = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not held or len(held) <= keep:
            return 0
        tail = held[keep:]
        del held[keep:]
        assert self._num_cached.get(request.request_id, 0) <= keep
        self.block_pool.free_blocks(reversed(tail))
        return len(tail)

    def free(self, request: Request) -> None:
        """Release all the request's blocks (finished, aborted or preempted). Idempotent."""
        rid = request.request_id
        held = self._blocks.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        if held:
            self.block_pool.free_blocks(reversed(held))

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes; stats are kept (they are monotonic counters)."""
        return self.block_pool.reset_prefix_cache()
