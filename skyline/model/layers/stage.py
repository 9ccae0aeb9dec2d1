"""What stands in for the modules a pipeline stage does not run (model/partition.py).

A stage hands the next one a single tensor per step: the residual stream, x + residual, the
sum the next layer's fused add-and-norm would have formed (in the model dtype, as that add
is). The next stage's first layer, given no residual, takes it as its input and residual
alike, so the layers compute what one process computes.
"""

from __future__ import annotations

import torch
from torch import nn


class StageInput(nn.Module):
    """In place of the embedding on a later stage: the forward's "input ids" are the hidden
    states [num_tokens, hidden] the previous stage sent."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class StageOutput(nn.Module):
    """In place of the final norm on an earlier stage: the residual stream to send on."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, None]:
        return (x if residual is None else x + residual), None


class SkipLayer(nn.Module):
    """A decoder layer another stage runs."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return x, residual


class NoHead(nn.Module):
    """In place of the LM head on an earlier stage (it computes no logits)."""

    tied = False
