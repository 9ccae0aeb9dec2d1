"""KV headroom at admission: blocks held back for the tokens running requests will still add.

Admitting on current need alone fills the cache with prompts whose outputs then do not fit:
once the running requests' decodes outgrow the free blocks the scheduler preempts, and a
preempted request's KV is recomputed from scratch (under that pressure its freed blocks are
soon evicted, so the recompute finds few prefix hits). In 1,000 x (1,000 in, 1,000 out) on an
H200's 0.89 M-token cache this recomputed half a million prompt tokens in 389 preemptions.

So a waiting request is admitted only while the free blocks, after its allocation, still cover
what every running request (and itself) is expected to add: `ratio` x its remaining output
budget (max_tokens, within the model's length), beyond the blocks it holds. `ratio` is learned
from the traffic: it starts at 1 (the whole budget, as TensorRT-LLM's guaranteed-no-evict
policy), moves towards the share of its budget each finished request used (their mean, then a
running mean: requests that stop early soon reserve little) and back up on a preemption (the
estimate was short). Requests without max_tokens have the context length for a budget, too
loose to plan by: each reserves the mean output of finished requests without max_tokens (none
before the first), however much it has produced. Preemption remains the fallback for estimates
that miss.

Holding back has a cost of its own at the end of a queue: when the cache holds the queue's
requests at full length in, say, 2.07 waves, the last 7% would run alone after the rest, a tail
of small steps. So once the whole queue fits the free blocks and everyone's expected need
exceeds the cache by at most OVERCOMMIT of it, the queue starts at once (`start_all`).

SchedulerConfig.schedule_conservativeness scales the ratio (SGLang's option of that name);
0 turns the headroom off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from skyline.types import Request

MEAN_WEIGHT = 1 / 32  # a finished request's least weight in the running mean of used shares
# How far everyone's expected need may exceed the cache for the last of the queue to start at
# once (Headroom.start_all): the excess is preempted near the end and recomputed once.
OVERCOMMIT = 1 / 8


def fits_now(waiting: Iterable[Request], num_free: int, block_size: int) -> bool:
    """Whether every waiting request's tokens (prompt, and output so far when preempted) fit
    in `num_free` blocks (prefix hits not counted): stops at the first that does not."""
    for req in waiting:
        num_free -= -(-req.num_tokens // block_size)
        if num_free < 0:
            return False
    return True


class Headroom:
    """The learned share of remaining output budget a request is expected to use."""

    def __init__(self, block_size: int, conservativeness: float = 1.0,
                 overcommit: float | None = OVERCOMMIT) -> None:
        self.block_size = block_size
        self.scale = conservativeness
        self.overcommit = overcommit  # start_all's bound; None: the queue never starts at once
        self.ratio = 1.0
        self.num_finished = 0  # requests with max_tokens learned from
        self.unbounded_tokens = 0.0  # mean output of finished requests without max_tokens
        self.num_unbounded = 0

    @property
    def enabled(self) -> bool:
        return self.scale > 0

    def future_blocks(self, req: Request, num_held: int, max_len: int) -> int:
        """Blocks `req` is expected to need beyond the `num_held` it holds: the rest of its
        prompt and `ratio` of its remaining output budget (within `max_len` tokens), or
        without max_tokens the mean output of such requests."""
        n = len(req.all_token_ids)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is None:
            n += int(min(self.scale * self.unbounded_tokens, max_len - n) + 0.999)
        else:
            budget = min(max_tokens - len(req.output_token_ids), max_len - n)
            if budget > 0:
                n += int(min(1.0, self.ratio * self.scale) * budget + 0.999)
        return max(0, -(-n // self.block_size) - num_held)

    def reserved(self, running: Iterable[Request], blocks: Callable[[str], list],
                 max_len: Callable[[Request], int]) -> int:
        """Blocks held back for the running requests (`blocks(request_id)`: a request's
        blocks; `max_len(request)`: its cap on tokens)."""
        return sum(self.future_blocks(r, len(blocks(r.request_id)), max_len(r))
                   for r in running)

    def start_all(self, running: list[Request], waiting: Iterable[Request],
                  blocks: Callable[[str], list], max_len: Callable[[Request], int],
                  num_free: int, reserve: int) -> bool:
        """Whether the whole queue starts now on current need: it fits the free blocks, and
        what the running (holding their blocks, expected to add `reserve`: `reserved`'s) and
        waiting requests are expected to hold at most exceeds the cache by no more than
        `overcommit` of it. Held back, that remainder would run alone after everyone else, a
        tail of small steps (as long as its outputs); admitted, the excess is preempted near
        the end and recomputed once."""
        if self.overcommit is None or not fits_now(waiting, num_free, self.block_size):
            return False
        held = sum(len(blocks(r.request_id)) for r in running)
        need = held + reserve + sum(self.future_blocks(r, 0, max_len(r)) for r in waiting)
        return need <= (held + num_free) * (1 + self.overcommit)

    def finished(self, req: Request, max_len: int) -> None:
        """A request ended by a stop or its length: learn the share of its budget it used
        (the plain mean of the first ones, the starting 1 counting as one, then a running mean
        that forgets), or without max_tokens how many tokens it produced."""
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is None:
            self.num_unbounded += 1
            weight = max(MEAN_WEIGHT, 1 / self.num_unbounded)
            self.unbounded_tokens += weight * (req.num_output_tokens - self.unbounded_tokens)
            return
        budget = min(max_tokens, max_len - req.num_prompt_tokens)
        if budget > 0:
            self.num_finished += 1
            weight = max(MEAN_WEIGHT, 1 / (self.num_finished + 1))
            used = min(1.0, req.num_output_tokens / budget)
            self.ratio += weight * (used - self.ratio)

    def preempted(self) -> None:
        """A step preempted: the expected need fell short; halve the distance to the budget."""
        self.ratio += (1.0 - self.ratio) / 2
