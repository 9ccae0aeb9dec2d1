"""A hidden-state proposer that drafts nothing and keeps every position's hidden state: what
the runner hands an EAGLE proposer, observed from outside (test_eagle.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FeatureRecorder:
    """A HiddenStateProposer that drafts nothing and keeps the hidden state of every position
    the target computes (on the CPU, in the model dtype), by request and position."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def observe(self, req_ids: Sequence[str], starts: Sequence[int],
                hidden: Sequence[torch.Tensor], token_ids: Sequence[Sequence[int]]) -> None:
        for rid, start, rows in zip(req_ids, starts, hidden, strict=True):
            self.chunks.setdefault(rid, []).append((start, rows.to("cpu", copy=True)))

    def propose(self, req_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                max_depth: int) -> list[list[int]]:
        return [[] for _ in req_ids]

    def finish(self, req_id: str, token_ids: Sequence[int]) -> None:
        pass  # a preempted request is computed again: later chunks overwrite its positions

    def features(self, req_id: str, num_tokens: int) -> torch.Tensor:
        """[m, hidden]: positions 0..m-1, m the first position never computed (<= num_tokens)."""
        chunks = self.chunks.pop(req_id, [])
        if not chunks:
            return torch.empty(0, 0)
        feats = chunks[0][1].new_empty(num_tokens, chunks[0][1].shape[1])
        done = torch.zeros(num_tokens, dtype=torch.bool)
        for start, rows in chunks:  # in step order: a recompute overwrites
            n = min(rows.shape[0], num_tokens - start)
            feats[start : start + n] = rows[:n]
            done[start : start + n] = True
        m = int(done.long().cumprod(0).sum())
        return feats[:m]

