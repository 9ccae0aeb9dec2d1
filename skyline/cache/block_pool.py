"""The pool of KV-cache blocks: ids, reference counts, the LRU free queue and the prefix-hash map.

Invariants (checked by `check_invariants`, which tests call):
- a block is in the free queue  <=>  its ref_cnt is 0;
- `_cached[h] is b`  =>  `b.block_hash == h`; a block whose hash was displaced by another block
  carrying the same hash keeps no hash at all (see `cache_full_block`);
- a free block that still carries a hash is an *evictable* cached block: `touch` can revive it
  until `get_new_blocks` reallocates it, which drops its hash.

With `record_events`, the pool logs every hash that becomes findable (STORED), stops being
findable (REMOVED) and the forgetting of all of them (CLEARED), in order, for a router that
keeps an index of which replica holds which prefix (engine/kv_events.py publishes them).
Replaying the log over the hashes findable before it gives exactly `_cached`'s keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from skyline.cache.prefix import BlockHash
from skyline.types import KVEventKind


class BlockListener(Protocol):
    """Told when a block's KV becomes findable by hash, and when it is about to be overwritten
    (a KV connector writes such blocks down to a lower tier: cache/connector.py)."""

    def block_cached(self, block_id: int, block_hash: BlockHash) -> None: ...

    def block_evicted(self, block_id: int, block_hash: BlockHash) -> None: ...


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and computed

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class BlockPool:
    """Hands out blocks and takes them back; remembers full blocks by hash for prefix reuse.

    The free queue is in eviction order: `get_new_blocks` takes from the head. Freed blocks that
    carry a hash go to the tail (most recently used, evicted last); freed blocks without a hash
    hold nothing anyone can reuse, so they go to the head and are handed out first.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 listener: BlockListener | None = None,
                 record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.listener = listener
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, head first. OrderedDict gives O(1) removal from the middle (`touch`).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # (KVEventKind, hashes) in order, consecutive events of a kind merged; None: not kept
        self._events: list[tuple[int, list[BlockHash]]] | None = [] if record_events else None

    # ---------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, including evictable cached ones."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block whose computed KV holds the tokens behind `block_hash`, if still cached."""
        return self._cached.get(block_hash)

    def cached_hashes(self) -> list[BlockHash]:
        """Every findable hash (a KV-event snapshot)."""
        return list(self._cached)

    def take_events(self) -> list[tuple[int, list[BlockHash]]]:
        """The events recorded since the last call (none unless `record_events`)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def _record(self, kind: KVEventKind, block_hash: BlockHash) -> None:
        if self._events is None:
            return
        if self._events and self._events[-1][0] == kind:
            self._events[-1][1].append(block_hash)
        else:
            self._events.append((kind, [block_hash]))

    # ---------------------------------------------------------------- changes

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue (ref_cnt 1), evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a request reuses (reviving them if they were free)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Callers pass a request's blocks tail first, so that
        the end of a sequence (least likely to be shared) is evicted before its prefix."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full, computed block findable by `block_hash`.

        If another block already holds this hash (two requests computed the same prefix at the
        same time), the first one stays the canonical copy and this block stays unhashed: it is
        freed like any private block. A block is hashed at most once."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
            self._record(KVEventKind.STORED, block_hash)
            if self.listener is not None:
                self.listener.block_cached(block.block_id, block_hash)

    def reset_prefix_cache(self) -> int:
        """Forget every hash (e.g. after a weight update: all cached KV is stale). Blocks in use
        stay with their requests but are no longer shareable. Returns the number forgotten."""
        n = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events[:] = [(KVEventKind.CLEARED, [])]  # what came before no longer matters
        return n

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self._record(KVEventKind.REMOVED, block.block_hash)
            if self.listener is not None:
                self.listener.block_evicted(block.block_id, block.block_hash)
        block.block_hash = None

    # ---------------------------------------------------------------- testing

    def check_invariants(self) -> None:
        """Assert the invariants in the module docstring (O(num_blocks); for tests)."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
        for h, block in self._cached.items():
            assert block.block_hash == h, block
        hashed = sum(b.block_hash is not None for b in self.blocks)
        assert hashed == len(self._cached), (hashed, len(self._cached))
