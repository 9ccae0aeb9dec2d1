"""KV events: what a replica's prefix cache gained or lost, for the router."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# engine core -> router (KV events, over ZMQ PUB; see engine/kv_events.py and router/events.py)


class KVEventKind(enum.IntEnum):
    STORED = 0  # block hashes now findable in the prefix cache, in chain order
    REMOVED = 1  # block hashes evicted
    CLEARED = 2  # every hash forgotten (no hashes)


@dataclass
class KVEventBatch:
    """What changed in one engine's prefix cache since the last batch, and its load.

    `epoch` names one engine process: a new one (a restart) starts again at seq 1, and a
    subscriber that sees another epoch, or a seq that is not last + 1, resynchronizes from a
    snapshot. A batch without events repeats the last seq (load only, or a heartbeat)."""

    epoch: str
    seq: int
    events: list[tuple[int, list[bytes]]] = field(default_factory=list)  # (KVEventKind, hashes)
    # num_running, num_waiting, kv_usage (fraction of blocks held by requests)
    load: dict[str, float] = field(default_factory=dict)

    def to_wire(self) -> list[Any]:
        return [self.epoch, self.seq, [[k, hs] for k, hs in self.events], self.load]

    @classmethod
    def from_wire(cls, v: list[Any]) -> KVEventBatch:
        epoch, seq, events, load = v
        return cls(str(epoch), int(seq), [(int(k), list(hs)) for k, hs in events], dict(load))


@dataclass
class KVSnapshot:
    """Every block hash an engine's prefix cache holds, as of its batch `seq`: the state a
    subscriber starts from, or resynchronizes to after a gap."""

    epoch: str
    seq: int
    hashes: list[bytes]

    def to_wire(self) -> list[Any]:
        return [self.epoch, self.seq, self.hashes]

    @classmethod
    def from_wire(cls, v: list[Any]) -> KVSnapshot:
        epoch, seq, hashes = v
        return cls(str(epoch), int(seq), list(hashes))
