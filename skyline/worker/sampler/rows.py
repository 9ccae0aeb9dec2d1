"""A request's row in a step's sampling: its parameters and token history (read by the
penalties), and host values sent to the device without waiting for it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from skyline.types import SamplingParams

MASK = float("-inf")  # a disallowed token's logit


@dataclass
class SamplingRow:
    """One row of the batch to sample: the request's params and token history."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: tuple[int, ...]  # masked while fewer than min_tokens outputs exist

    def __post_init__(self) -> None:
        self.bias: dict[int, float] | None = self.params.logit_bias or None
        # the biases' token ids and values on the device, made at the first step that needs
        # them (a row lives as long as its request)
        self.bias_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        # prompt then output ids, as far as the penalties have read them, in a buffer that
        # grows: a step appends its new outputs instead of converting the whole history
        self._ids = np.empty(0, dtype=np.int64)
        self._num_ids = 0
        # steps left that skip `_candidates` after this row's nucleus reached past them
        self.wide_nucleus = 0

    def history_ids(self) -> np.ndarray:
        """The prompt's token ids, then the outputs', as an array (the penalties', each step):
        only outputs new since the last call are converted."""
        p, out = len(self.prompt_token_ids), self.output_token_ids
        n = p + len(out)
        if self._num_ids == 0 or n < self._num_ids or (
                self._num_ids > p and self._ids[self._num_ids - 1] != out[self._num_ids - p - 1]):
            self._num_ids = 0  # first call, or outputs rewritten: start again
        if n > len(self._ids):
            grown = np.empty(max(n, 2 * len(self._ids), 64), dtype=np.int64)
            grown[: self._num_ids] = self._ids[: self._num_ids]
            self._ids = grown
        if self._num_ids < p:
            self._ids[:p] = self.prompt_token_ids
            self._num_ids = p
        if self._num_ids < n:
            self._ids[self._num_ids : n] = out[self._num_ids - p :]
            self._num_ids = n
        return self._ids[:n]

    def output_ids(self) -> np.ndarray:
        return self.history_ids()[len(self.prompt_token_ids) :]


def seed_for(seed: int, step: int) -> int:
    # Mix (seed, step) into one 63-bit generator seed (splitmix64 finaliser).
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def to_device(values: list[int] | list[float] | np.ndarray, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Host values on the device without waiting for them: a pageable copy would synchronise."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
