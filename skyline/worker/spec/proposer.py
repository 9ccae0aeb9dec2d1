"""The proposer interface: cheap guesses of each request's next tokens, verified by the target
model in one forward pass (the runner) and accepted by rejection sampling (`verify.py`).

Proposers run in the worker right after sampling. The n-gram and suffix proposers need token
ids only; the EAGLE head (`eagle_proposer.py`) also needs the device and the target's hidden
states (a `HiddenStateProposer`), and a draft model (`draft.py`) runs on the device with its own
paged KV cache, which is why proposers live beside the runner and not in the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from skyline.config import SpecConfig

if TYPE_CHECKING:
    import torch
    from torch import nn


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


@runtime_checkable
class HiddenStateProposer(Proposer, Protocol):
    """A proposer that also reads the target's hidden states (the input of its LM head)."""

    def observe(
        self,
        req_ids: Sequence[str],
        starts: Sequence[int],
        hidden: Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[int]],
    ) -> None:
        """Called every step right after the target's forward pass, before sampling: request
        i computed positions starts[i].. with hidden states hidden[i] [n_i, hidden_size] (a
        verification's rows include its drafts); token_ids[i] are its tokens so far. Rows of
        drafts the verification rejects are the proposer's to drop: at the next `propose` of
        the request its token ids tell how many drafts were accepted."""
        ...


def make_proposer(cfg: SpecConfig, model: nn.Module | None = None) -> Proposer | None:
    """The proposer of `cfg.method`; `model` is the target (the EAGLE head shares its
    embedding, final norm and LM head; a draft model takes its device and dtype)."""
    if cfg.method == "none":
        return None
    if cfg.method == "ngram":
        from skyline.worker.spec.ngram import NgramProposer

        return NgramProposer(cfg.ngram_min, cfg.ngram_max)
    if cfg.method == "suffix":
        from skyline.worker.spec.suffix import SuffixProposer

        return SuffixProposer(cfg.ngram_min, cfg.ngram_max, cfg.suffix_traffic_tokens)
    if cfg.method == "eagle":
        from skyline.worker.spec.eagle_proposer import EagleProposer

        assert model is not None, "the EAGLE proposer needs the target model"
        return EagleProposer(cfg, model)
    if cfg.method == "draft":
        from skyline.worker.spec.draft import DraftProposer

        assert model is not None, "the draft proposer needs the target model"
        return DraftProposer(cfg, model)
    raise AssertionError(f"unknown speculative method {cfg.method!r}")  # SpecConfig validates
