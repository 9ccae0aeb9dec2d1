"""How many threads a small CPU step runs on, chosen by measuring both.

A decode step of a small model is a few milliseconds of operations too small to share well,
and in a server the API process needs a core for every token it streams: an engine thread that
waits for that core stalls every parallel region, so one thread can be 1.5x faster than two
(BENCHMARKS.md, "CPU (default model)"). On an idle machine the weight products of the same
step run nearly twice as fast on two threads. Neither choice is right everywhere, and the load
changes while an engine runs, so each size of small step (1 .. `small_tokens` tokens) keeps a
moving average of its seconds on one thread and on all of them, runs the faster, and tries the
other every `explore_every` steps of that size, or less often where it measured much slower:
a retry may cost at most EXPLORE_COST of the size's time. (Where one thread is 10x slower, a
large model's layers on a many-core host, a retry every 32 steps would add 9/32 to the time.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past in a moving average of step seconds
EXPLORE_COST = 0.03  # the most of a size's step time its retries of the slower choice take


@dataclass
class _Size:
    seconds: dict[int, float] = field(default_factory=dict)  # threads -> moving average
    since: int = 0  # steps since the slower choice was last tried


class StepThreads:
    """The thread count of each small step (`choose`), from the seconds of past ones
    (`record`)."""

    def __init__(self, threads: int, small_tokens: int, explore_every: int = 32) -> None:
        self.threads = threads
        self.small_tokens = small_tokens
        self.explore_every = explore_every
        self._sizes: dict[int, _Size] = {}

    def choose(self, tokens: int) -> int:
        """Threads for a step of `tokens` tokens: all of them above `small_tokens`; for a small
        step, each choice once, then the faster on average, and the other after
        `explore_every` steps of the size, or as many more as keep the retry's extra time
        within EXPLORE_COST of theirs."""
        if self.threads <= 1 or tokens > self.small_tokens:
            return self.threads
        size = self._sizes.setdefault(tokens, _Size())
        for n in (1, self.threads):
            if n not in size.seconds:
                return n
        best = min(size.seconds, key=size.seconds.__getitem__)
        other = self.threads if best == 1 else 1
        excess = size.seconds[other] / max(size.seconds[best], 1e-9) - 1
        size.since += 1
        if size.since >= max(self.explore_every, math.ceil(excess / EXPLORE_COST)):
            size.since = 0
            return other
        return best

    def record(self, tokens: int, threads: int, seconds: float) -> None:
        """A step's seconds on `threads` threads."""
        size = self._sizes.get(tokens)
        if size is None:
            return
        old = size.seconds.get(threads)
        size.seconds[threads] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def summary(self) -> dict[int, dict[int, float]]:
        """Tokens -> {threads: average seconds}: what it has measured."""
        return {t: dict(s.seconds) for t, s in sorted(self._sizes.items())}
