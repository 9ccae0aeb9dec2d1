"""Chained block hashes: the identity of a full block of tokens *and everything before it*.

hash(block i) = sha256(hash(block i-1) || token ids of block i as little-endian int64), with the
empty string as the parent of block 0 (or a salt, to keep tenants' or adapters' caches apart).
Two blocks share a hash only if their whole prefixes match, so a chain of hits is a valid KV
prefix.

Why sha256 rather than Python's `hash` of a tuple: both are deterministic across processes
(PYTHONHASHSEED randomizes str/bytes hashing, not ints or tuples of ints), but tuple hashing is
64-bit and not collision-resistant, and a collision here would let one request attend to another's
KV. sha256 costs about 0.8 us per 16-token block (measured, Python 3.11, 2-core CPU) against
0.17 us for `hash`: 0.4 ms once for an 8k-token prompt, and one hash per block_size decoded tokens
afterwards — negligible next to a forward pass. The digests also serve as stable keys for other
processes (router, KV tiers).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 32-byte sha256 digest

ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block given its parent's hash (ROOT_HASH, or a salt, for block 0)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, salt: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, salt)
    return hashes


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    salt: BlockHash = ROOT_HASH,
) -> int:
    """Append to `hashes` the hashes of blocks of `token_ids` that became full since the last call.

    Invariant: `hashes` holds the hashes of the first `len(hashes)` blocks of `token_ids`, whose
    tokens never change (tokens are only appended). Cost is proportional to the new blocks only.
    Returns the number of hashes appended."""
    num_full = len(token_ids) // block_size
    start = len(hashes)
    parent = hashes[-1] if hashes else salt
    for i in range(start, num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return max(0, num_full - start)
