"""Which replica holds which prefix: chained block hashes (cache/prefix.py) per replica.

A prompt's hashes are chained, so a replica holds the prompt's first k blocks exactly when it
holds the hashes of blocks 0..k-1; `match` walks the prompt's hashes once for all replicas.
The index is fed by each replica's KV events (router/events.py): exact, including evictions.
A replica without events gets an approximate entry instead: the hashes of the prompts the
router sent it, the oldest forgotten past a cap (as SGLang's router guesses from its own
routing, without knowing what the engine evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

_NONE: frozenset[int] = frozenset()


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}  # hash -> replicas that hold it
        # replica -> its hashes, oldest first (the order only matters for approximate entries)
        self._held: dict[int, OrderedDict[bytes, None]] = {}

    def num_hashes(self, replica: int) -> int:
        return len(self._held.get(replica, ()))

    def store(self, replica: int, hashes: Iterable[bytes], cap: int | None = None) -> None:
        """The replica now holds `hashes`; with `cap`, it forgets its oldest beyond that."""
        held = self._held.setdefault(replica, OrderedDict())
        for h in hashes:
            if h in held:
                held.move_to_end(h)
                continue
            held[h] = None
            self._holders.setdefault(h, set()).add(replica)
        while cap is not None and len(held) > cap:
            old, _ = held.popitem(last=False)
            self._drop(old, replica)

    def remove(self, replica: int, hashes: Iterable[bytes]) -> None:
        held = self._held.get(replica)
        if held is None:
            return
        for h in hashes:
            if h in held:
                del held[h]
                self._drop(h, replica)

    def clear(self, replica: int) -> None:
        for h in self._held.pop(replica, ()):
            self._drop(h, replica)

    def replace(self, replica: int, hashes: Iterable[bytes]) -> None:
        self.clear(replica)
        self.store(replica, hashes)

    def _drop(self, h: bytes, replica: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[h]

    def match(self, hashes: list[bytes], replicas: Iterable[int]) -> dict[int, int]:
        """For each replica, how many leading blocks of the prompt it holds."""
        alive = set(replicas)
        matched = dict.fromkeys(alive, 0)
        for i, h in enumerate(hashes):
            lost = alive - self._holders.get(h, _NONE)
            for r in lost:
                matched[r] = i
            alive -= lost
            if not alive:
                return matched
        for r in alive:
            matched[r] = len(hashes)
        return matched
