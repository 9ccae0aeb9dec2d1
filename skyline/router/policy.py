"""Routing policies: which healthy replica gets a request.

- round-robin: in turn, whatever each holds.
- least-load: the fewest requests open on it (the router's own count, exact and immediate),
  then the shortest waiting queue and the emptiest KV cache its events report.
- cache-aware: the longest cached prefix of the prompt (router/index.py), unless that
  replica is overloaded, as SGLang's router balances: a replica is overloaded when it has at
  least `balance_abs` more requests open than the least-loaded one *and* more than
  `balance_rel` times as many, or its KV cache is full with requests waiting. Without a hit
  anywhere, a request goes to the least-loaded replica, so new prefixes spread out while each
  known one stays where it is cached.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from skyline.router.replica import Replica


@dataclass(frozen=True)
class Choice:
    replica: Replica
    hit_blocks: int  # blocks of the prompt the index says it holds


class Policy:
    def __init__(self, name: str = "cache-aware", balance_abs: int = 4,
                 balance_rel: float = 1.5, full_kv: float = 0.98) -> None:
        self.name = name
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.full_kv = full_kv
        self._turn = itertools.count()

    @property
    def uses_cache(self) -> bool:
        return self.name == "cache-aware"

    def choose(self, replicas: list[Replica], hits: dict[int, int]) -> Choice:
        """Pick among `replicas` (healthy, non-empty); `hits`: replica index -> blocks held."""
        turn = next(self._turn)
        if self.name == "round-robin":
            r = replicas[turn % len(replicas)]
            return Choice(r, hits.get(r.index, 0))
        # Rotating the candidates first breaks ties in turn rather than always to the first.
        k = turn % len(replicas)
        rotated = replicas[k:] + replicas[:k]
        least = min(rotated, key=_load_key)
        if self.name == "least-load":
            return Choice(least, hits.get(least.index, 0))
        lo = least.in_flight
        fit = [r for r in rotated if not self._overloaded(r, lo)] or [least]
        best = max(fit, key=lambda r: (hits.get(r.index, 0), -r.in_flight))
        if hits.get(best.index, 0) == 0:
            best = least
        return Choice(best, hits.get(best.index, 0))

    def _overloaded(self, r: Replica, lo: int) -> bool:
        busy = r.in_flight >= lo + self.balance_abs and r.in_flight > self.balance_rel * lo
        return busy or (r.kv_usage >= self.full_kv and r.waiting > 0)


def _load_key(r: Replica) -> tuple[float, float, float]:
    return (r.in_flight, r.waiting, r.kv_usage)
