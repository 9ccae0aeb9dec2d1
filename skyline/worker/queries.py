"""What tools and start-up ask of a loaded model, answered where the model lives.

Each query is a function of the rank's `ModelRunner` and plain arguments, returning plain data
or CPU tensors, so that any executor can run it: in its own process, or on every rank's
worker (`Executor.query(name, *args)`). One dict names them all. With several ranks the
answer is the driver's (the rank that samples), or that of the query's entry in `COMBINE`
over every rank's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from skyline.model.cost import ModelCost
from skyline.worker.kv_cache import bytes_per_block
from skyline.worker.runner import ModelRunner


def describe(r: ModelRunner) -> dict[str, Any]:
    """What start-up reports: the KV cache's size, load time, weights' size."""
    tensors = [*r.model.parameters(), *r.model.buffers()]
    return {
        "num_blocks": r.num_blocks,
        "kv_cache_gib": r.kv_cache_bytes / 2**30,
        "kv_cache_tokens": r.num_blocks * r.block_size,
        "load_seconds": r.load_seconds,
        "weights_gib": sum(t.numel() * t.element_size() for t in tensors) / 2**30,
    }


@torch.inference_mode()
def score(r: ModelRunner, token_ids: list[int]) -> torch.Tensor | None:
    """Log-probs of the next token at every position of `token_ids` (teacher forcing): one
    causal forward pass outside the KV cache. Returns [len(token_ids), vocab] float32 on the
    CPU (None on ranks other than the driver)."""
    ids = torch.tensor(token_ids, device=r.device)
    hidden = r.forward_stages(ids, torch.arange(len(ids), device=r.device))  # [n, hidden]
    logits = r.model.compute_logits(hidden) if hidden is not None else None
    return logits.float().log_softmax(-1).cpu() if logits is not None else None


def device_wait_seconds(r: ModelRunner) -> float:
    """Seconds the host has waited for sampled tokens so far (near zero when the host, not
    the device, sets the pace of the steps)."""
    return r.device_wait_s


def model_cost(r: ModelRunner) -> ModelCost:
    """The loaded model's cost per token as it serves (bench/floor.py)."""
    return ModelCost.of(r.model, bytes_per_block(r.kv_arch, 1, r.kv_dtype))


def null_forward(r: ModelRunner) -> None:
    """From now on the model computes zeros at no cost (bench/): what remains of a step is the
    engine's and the executor's own work."""
    hidden, vocab = r.arch.hidden_size, r.arch.vocab_size
    r.model.forward = lambda ids, positions: torch.zeros(
        positions.shape[0], hidden, dtype=r.dtype, device=r.device)
    r.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab, device=r.device)
    r.graphs = None


def _describe_all(values: list[dict[str, Any]], driver: int) -> dict[str, Any]:
    """Every rank's memory added up; the slowest load."""
    out = dict(values[driver])
    for key in ("kv_cache_gib", "weights_gib"):
        out[key] = sum(v[key] for v in values)
    out["load_seconds"] = max(v["load_seconds"] for v in values)
    out["ranks"] = len(values)
    return out


def _cost_all(values: list[ModelCost], driver: int) -> ModelCost:
    """The whole model's cost: the sum of its parts."""
    return ModelCost(**{f.name: sum(getattr(v, f.name) for v in values)
                        for f in dataclasses.fields(ModelCost)})


QUERIES: dict[str, Callable[..., Any]] = {
    "describe": describe,
    "score": score,
    "device_wait_seconds": device_wait_seconds,
    "model_cost": model_cost,
    "null_forward": null_forward,
}
# query -> (every rank's answer, the driver's index) -> the answer
COMBINE: dict[str, Callable[[list[Any], int], Any]] = {
    "describe": _describe_all,
    "model_cost": _cost_all,
}
