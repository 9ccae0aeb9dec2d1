"""Executors run a SchedulerOutput on the workers. One device today: a direct call."""

from __future__ import annotations

import torch

from skyline.config import EngineConfig
from skyline.types import RunnerOutput, SchedulerOutput
from skyline.worker.runner import ModelRunner


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(out)

    def launch(self, out: SchedulerOutput) -> RunnerOutput | None:
        """Queue a step; returns the output of the step that was in flight, if any."""
        return self.runner.launch(out)

    def collect(self) -> RunnerOutput:
        return self.runner.collect()

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Log-probs of the next token at every position of `token_ids` (teacher forcing):
        one causal forward pass outside the KV cache. Returns [len(token_ids), vocab] float32
        on the CPU."""
        r = self.runner
        ids = torch.tensor(token_ids, device=r.device)
        hidden = r.model(ids, torch.arange(len(ids), device=r.device))  # [n, hidden]
        return r.model.compute_logits(hidden).float().log_softmax(-1).cpu()

    def describe(self) -> dict[str, float]:
        r = self.runner
        return {
            "num_blocks": r.num_blocks,
            "kv_cache_gib": r.kv_cache_bytes / 2**30,
            "kv_cache_tokens": r.num_blocks * r.block_size,
            "load_seconds": r.load_seconds,
        }
