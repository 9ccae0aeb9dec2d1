"""The proposer interface: cheap guesses of each request's next tokens, verified by the target
model in one forward pass (the runner) and accepted by rejection sampling (`verify.py`).

Proposers run in the worker right after sampling. The n-gram and suffix proposers need token
ids only; a draft model or EAGLE head (not yet written) will also need the device and the
target's hidden states, which is why they live beside the runner and not in the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from skyline.config import SpecConfig


class Proposer(Protocol):
    def propose(
        self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]], max_depth: int
    ) -> list[list[int]]:
        """Up to `max_depth` draft tokens to follow each request's `token_ids` (prompt and
        output so far); an empty list where there is no good guess."""
        ...

    def finish(self, req_id: str, token_ids: Sequence[int]) -> None:
        """The runner forgot the request (finished, aborted or preempted)."""
        ...


def make_proposer(cfg: SpecConfig) -> Proposer | None:
    if cfg.method == "none":
        return None
    if cfg.method == "ngram":
        from skyline.spec.ngram import NgramProposer

        return NgramProposer(cfg.ngram_min, cfg.ngram_max)
    if cfg.method == "suffix":
        from skyline.spec.suffix import SuffixProposer

        return SuffixProposer(cfg.ngram_min, cfg.ngram_max, cfg.suffix_traffic_tokens)
    raise AssertionError(f"unknown speculative method {cfg.method!r}")  # SpecConfig validates
