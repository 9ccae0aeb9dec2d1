"""What tools, benchmarks and start-up ask of a loaded model, answered where the model lives.

Each query is a function of the rank's `ModelRunner` and plain arguments, returning plain data
or CPU tensors, so that any executor can run it: in its own process, or on every rank's
worker (`Executor.query(name, *args)`). One dict names them all. With several ranks every rank
runs the query (a forward pass needs them all); the answer is the driver's (the rank that
samples), or that of the query's entry in `COMBINE` over every rank's. The tools' queries
(`ONE_RANK`) need the whole model in one process. The algorithms are the packages' (quant/ for
calibration, quantization and the format search, worker/spec/ for the EAGLE head's training);
a query only hands them the runner's model.

Queries that read or change the Linear weights first put the model back in its plain layout
(model/loader.py: `plain_layout`), so that what they compute is what a freshly loaded model
computes, whatever packing the engine served with; the engine goes on serving (a CPU engine
through F.linear). Quantizing leaves the engine's model quantized: a tool shuts the engine
down afterwards. The bench probes at the end change how the engine computes, for one
measurement each; a benchmark's engine is not used for anything else.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from skyline import envs
from skyline.config import QuantConfig, TrainArgs
from skyline.model.checkpoint import write_checkpoint
from skyline.model.cost import ModelCost
from skyline.model.loader import plain_layout
from skyline.model.weights import cpu_kernels, held_bytes
from skyline.ops import cpu_int4
from skyline.ops.pdl import use_pdl
from skyline.ops.triton_utils import compiled_so_far
from skyline.quant import report
from skyline.quant.assignment import parse_formats, to_quant_config
from skyline.quant.calibrate import collect_act_sq as _collect_act_sq
from skyline.quant.checkpoint import quantize_loaded
from skyline.quant.intq import round_linear_inputs_int8
from skyline.quant.method import iter_linears
from skyline.worker.connector.base import merge_info
from skyline.worker.cuda_graph import GraphShape
from skyline.worker.kv_cache import bytes_per_block, calibrate_kv_scales
from skyline.worker.overlap_probe import decode_overlap_seconds
from skyline.worker.runner import ModelRunner
from skyline.worker.spec.train import Sample, train_and_save
from skyline.worker.step_probe import mixed_step_seconds

ActSq = dict[str, torch.Tensor]


def describe(r: ModelRunner) -> dict[str, Any]:
    """What start-up reports: the KV cache's size, load and CUDA-graph capture times, the
    weights' size (as held for serving: packed and quantized layouts included)."""
    return {
        "num_blocks": r.num_blocks,
        "kv_cache_gib": r.kv_cache_bytes / 2**30,
        "kv_cache_tokens": r.num_blocks * r.block_size,
        "load_seconds": r.load_seconds,
        "weights_gib": held_bytes(r.model.modules()) / 2**30,
        # of those, the experts held in host memory (--n-cpu-moe)
        "host_experts_gib": held_bytes(m for m in r.model.modules()
                                       if getattr(m, "weight_device", None) == "cpu") / 2**30,
        # the KV budget's other terms (CUDA): in use before sizing it, the largest step's peak
        "memory_in_use_gib": r.memory_in_use_bytes / 2**30,
        "profile_peak_gib": r.profile_peak_bytes / 2**30,
        "num_cuda_graphs": len(r.graphs.graphs) if r.graphs is not None else 0,
        # of those, the mixed steps' (a prefill chunk beside the decodes)
        "num_mixed_cuda_graphs": r.graphs.num_mixed if r.graphs is not None else 0,
        "cuda_graph_capture_seconds": getattr(r, "graph_capture_seconds", None),
        "pdl": use_pdl(r.device),  # programmatic dependent launch (SKYLINE_PDL)
        # start-up by phase (seconds, in order: they add up to the runner's start), each
        # graph's warm-up and capture, and the Triton compilations (or disk-cache loads)
        "startup": dict(r.startup.seconds),
        "cuda_graph_times": [g._asdict() for g in r.graphs.capture_times]
        if r.graphs is not None else [],
        "triton_compiles": r.triton_compiles.num,
        "triton_compile_seconds": r.triton_compiles.seconds,
        # the process's CPU threads (torch's) and OpenMP wait policy as the rank started
        "cpu_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        # a CPU rank's decode kernels (model/weights.py), one entry a CPU rank
        "cpu_kernels": [cpu_kernels(r.model)] if r.device.type == "cpu" else [],
    }


@torch.inference_mode()
def score(r: ModelRunner, token_ids: list[int],
          kv_scales: list[tuple[float, float]] | None = None) -> torch.Tensor | None:
    """Log-probs of the next token at every position of `token_ids` (teacher forcing): one
    causal forward pass outside the KV cache (K and V rounded as an fp8 cache stores them,
    with the layers' scales, or `kv_scales` of every layer of the model for this pass).
    Returns [len(token_ids), vocab] float32 on the CPU (None on ranks other than the
    driver)."""
    layers = r.model.attention_layers()
    saved = [(layer.k_scale, layer.v_scale) for layer in layers]
    stage = r.layout.stage
    given = kv_scales[stage.start : stage.end] if kv_scales is not None else saved
    try:
        for layer, (k, v) in zip(layers, given, strict=True):
            layer.k_scale, layer.v_scale = k, v
        ids = torch.tensor(token_ids, device=r.device)
        hidden = r.forward_stages(ids, torch.arange(len(ids), device=r.device))  # [n, hidden]
        logits = r.model.compute_logits(hidden) if hidden is not None else None
        return logits.float().log_softmax(-1).cpu() if logits is not None else None
    finally:
        for layer, (k, v) in zip(layers, saved, strict=True):
            layer.k_scale, layer.v_scale = k, v


def kv_scales(r: ModelRunner, token_ids: list[int] | None = None) -> list[tuple[float, float]]:
    """Per-layer (k_scale, v_scale) of an fp8 KV cache: the engine's, or (given token ids)
    those the engine's calibration gives on that text (bench/kv_cache_quality.py). This rank's
    layers; `_kv_scales_all` makes the model's of every rank's."""
    layers = r.model.attention_layers()
    if token_ids is None:
        return [(layer.k_scale, layer.v_scale) for layer in layers]
    caches = [layer.kv_cache for layer in layers]
    try:  # calibrated as at start-up, before the layers had a cache to round K and V for
        for layer in layers:
            layer.kv_cache = None
        return calibrate_kv_scales(r.model, r.arch.vocab_size, r.config.model.max_model_len,
                                   r.device, token_ids, forward=r.forward_stages)
    finally:
        for layer, cache in zip(layers, caches, strict=True):
            layer.kv_cache = cache


@torch.inference_mode()
def hidden_states(r: ModelRunner, sequences: list[list[int]]) -> list[torch.Tensor] | None:
    """The target's hidden state (its LM head's input) at every position of each sequence, by
    a causal forward pass over it outside the KV cache: [len(seq), hidden] on the CPU in the
    model's dtype (the EAGLE head's training features, tools/speculator/data.py); None on
    ranks other than the last stage's."""
    out = []
    for seq in sequences:
        ids = torch.tensor(seq, device=r.device)
        hidden = r.forward_stages(ids, torch.arange(len(ids), device=r.device))
        if hidden is None:
            return None
        out.append(hidden.cpu())
    return out


def step_clocks(r: ModelRunner) -> dict[str, Any]:
    """For a step trace (engine/step_trace.py): the seconds the host has waited for sampled
    tokens so far (near zero when the host, not the device, sets the pace of the steps), and
    the Triton compilations since start-up (their number, seconds and kernels by name: a
    step's shape that no warm-up or capture reached)."""
    c = compiled_so_far().since(r.compiles_at_start)
    return {"wait_s": r.device_wait_s, "compiles": c.num, "compile_s": c.seconds,
            "kernels": dict(c.kernels)}


def linear_bytes(r: ModelRunner) -> int:
    """Bytes the Linear layers hold as they serve now (their formats' tensors, any CPU
    layout), the embedding and the LM head apart (bench/quant_quality.py)."""
    return held_bytes(iter_linears(r.model))


def model_cost(r: ModelRunner) -> ModelCost:
    """The loaded model's cost per token as it serves (skyline/bench/floor.py)."""
    return ModelCost.of(r.model, bytes_per_block(r.kv_arch, 1, r.kv_dtype))


# -- the quantize tool ------------------------------------------------------------------------


def collect_act_sq(r: ModelRunner, token_ids: list[int]) -> ActSq:
    """Calibration statistics of the (unquantized) model on `token_ids`: quant/calibrate.py."""
    plain_layout(r.model)
    return _collect_act_sq(r.model, token_ids)


def quantize(r: ModelRunner, quant: QuantConfig, act_sq: ActSq | None = None) -> None:
    """Quantize the loaded, unquantized model in place, each Linear to its format in `quant`,
    calibrated by `act_sq` (quant/checkpoint.py)."""
    plain_layout(r.model)
    quantize_loaded(r.model, quant, act_sq)


def save_quantized(r: ModelRunner, out_dir: str, quant: QuantConfig,
                   calibration: dict[str, Any]) -> dict[str, Any]:
    """Write the model, quantized as `quant`, to `out_dir`: model.safetensors and config.json
    (the model's own, with the quantization_config, which is returned). The tokenizer's files
    are the caller's."""
    return write_checkpoint(r.model, r.config.model, quant, out_dir, calibration)


def search_formats(r: ModelRunner, formats: str, group_size: int, budget: int,
                   token_ids: list[int], act_sq: ActSq | None, calib_tokens: int,
                   eval_tokens: int, search_kw: dict[str, Any]) -> dict[str, Any]:
    """The mixed-precision search for `budget` bytes over `formats` (a comma-separated list)
    and its report (quant/report.py), as plain data: the QuantConfig of the assignment
    ("quant"), assignment.json ("assignment") and report.json ("report"). Leaves the model
    quantized as the assignment, ready for `save_quantized`."""
    plain_layout(r.model)
    result, rep = report.search_report(r.model, token_ids, parse_formats(formats, group_size),
                                       budget, act_sq, calib_tokens, eval_tokens, **search_kw)
    return {"quant": to_quant_config(result.assignment),
            "assignment": report.assignment_summary(result), "report": rep}


def search_budgets(r: ModelRunner, formats: str, budgets: list[str], calib: list[int],
                   evals: list[int], act_sq: ActSq | None, search_kw: dict[str, Any]
                   ) -> dict[str, Any]:
    """Searches for several budgets sharing their preparation (bench/quant_search.py:
    quant/report.py's search_budgets); the model is left unquantized."""
    plain_layout(r.model)
    return report.search_budgets(r.model, calib, evals, parse_formats(formats), budgets,
                                 act_sq, **search_kw)


# -- the train-speculator tool ----------------------------------------------------------------


def train_eagle_head(r: ModelRunner, samples: list[tuple[list[int], int, torch.Tensor]],
                     args: TrainArgs, eos_ids: tuple[int, ...], out_dir: str,
                     about: dict[str, Any]) -> dict[str, Any]:
    """Train an EAGLE head for the model on (token ids, prompt length, features) samples and
    save it to `out_dir` (worker/spec/train.py); returns the training statistics."""
    return train_and_save(r.model, [Sample(*s) for s in samples], args, eos_ids, out_dir,
                          about)


# -- bench probes -----------------------------------------------------------------------------


def round_linear_inputs(r: ModelRunner) -> None:
    """Every Linear's input rounded to int8 per row and 32 columns from now on, as the CUDA
    W4A8 GEMV rounds it (bench/quant_quality.py)."""
    round_linear_inputs_int8(r.model)


def zero_forward(r: ModelRunner) -> None:
    """The model's forward pass and logits become zeros at no cost, on every rank: what
    remains of a step is the host's and the executor's work (bench/host_overhead.py,
    bench/parallel_overhead.py)."""
    hidden, vocab = r.arch.hidden_size, r.arch.vocab_size
    r.model.forward = lambda ids, positions: torch.zeros(
        positions.shape[0], hidden, dtype=r.dtype, device=r.device)
    r.model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab, device=r.device)
    r.graphs = None


def repeat_drafts(r: ModelRunner) -> None:
    """The proposer drafts the request's last token, as many times as asked, whatever the
    text: steps cost what speculation costs, whatever it predicts (bench/profile_spec_step.py)."""
    assert r.proposer is not None, "repeat_drafts needs an engine with a speculative method"
    r.proposer.propose = lambda rids, token_ids, depth: [[t[-1]] * depth for t in token_ids]


def unfuse(r: ModelRunner, names: list[str], graph_batches: list[int] | None = None) -> float:
    """The fusions `names` (envs.FUSIONS) run in their modular forms from now on, on every
    rank, and the CUDA graphs are captured again with them (only decode batches of
    `graph_batches` sizes when given: fewer graphs, quicker to capture); the seconds the capture
    took (bench/fused_vs_modular.py). The engine must have no step in flight."""
    envs.ENV = dataclasses.replace(envs.ENV, unfuse=envs.parse_unfuse(",".join(names)))
    if r.graphs is None:
        return 0.0
    t0 = time.perf_counter()
    r.graphs.graphs.clear()  # the old graphs and their memory pool go first
    if graph_batches is not None:
        r.graphs.shapes = [GraphShape(bs, bs, 1) for bs in sorted(set(graph_batches))]
    torch.cuda.empty_cache()
    r.graphs.capture()
    return time.perf_counter() - t0


def cpu_step_seconds(r: ModelRunner) -> dict[str, float]:
    """Seconds a CPU engine's steps spent since this probe's first call, which starts timing
    them, by part: "linears" (the int4 kernel's products called from Python: the layers'
    Linears; none where the C++ decode step of model/layers/cpu_decode.py runs them), "forward"
    (the layers, their Linears included), "lm_head", "sample", and the runner's host phases
    (bench/cpu_vs_llamacpp.py: where a decode step's time goes)."""
    spent = getattr(r, "step_s", None)
    if spent is None:
        spent = r.step_s = {"linears": [0.0], "forward": [0.0], "lm_head": [0.0],
                            "sample": [0.0]}
        cpu_int4.planes_mm = _timed(cpu_int4.planes_mm, spent["linears"])
        r.model.forward = _timed(r.model.forward, spent["forward"])
        r.model.compute_logits = _timed(r.model.compute_logits, spent["lm_head"])
        r._sample_part = _timed(r._sample_part, spent["sample"])  # type: ignore[method-assign]
    return {k: v[0] for k, v in spent.items()} | dict(r.host_s)


def _timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t
    return call


def host_seconds(r: ModelRunner) -> dict[str, float]:
    """Seconds the runner's host work took so far, by phase (bench/host_overhead.py)."""
    return dict(r.host_s)


def kv_connector_info(r: ModelRunner) -> dict[str, Any] | None:
    """What the scheduler's half of the KV connector needs at start-up (worker/connector/),
    or None without one. A multi-rank executor merges its ranks' answers (`merge_info`)."""
    return r.connector.info() if r.connector is not None else None


QUERIES: dict[str, Callable[..., Any]] = {
    "describe": describe,
    "score": score,
    "kv_scales": kv_scales,
    "hidden_states": hidden_states,
    "step_clocks": step_clocks,
    "model_cost": model_cost,
    "linear_bytes": linear_bytes,
    "collect_act_sq": collect_act_sq,
    "quantize": quantize,
    "save_quantized": save_quantized,
    "search_formats": search_formats,
    "search_budgets": search_budgets,
    "train_eagle_head": train_eagle_head,
    "round_linear_inputs": round_linear_inputs,
    "zero_forward": zero_forward,
    "repeat_drafts": repeat_drafts,
    "host_seconds": host_seconds,
    "cpu_step_seconds": cpu_step_seconds,
    "unfuse": unfuse,
    "kv_connector_info": kv_connector_info,
    "mixed_step_seconds": mixed_step_seconds,
    "decode_overlap_seconds": decode_overlap_seconds,
}
# The tools' queries: their algorithms take the whole model in one process.
ONE_RANK = frozenset({"collect_act_sq", "quantize", "save_quantized", "search_formats",
                      "search_budgets", "train_eagle_head"})


# -- answers of several ranks -----------------------------------------------------------------


def _describe_all(values: list[dict[str, Any]], driver: int) -> dict[str, Any]:
    """Every rank's memory added up; the slowest load."""
    out = dict(values[driver])
    for key in ("kv_cache_gib", "weights_gib", "host_experts_gib"):
        out[key] = sum(v[key] for v in values)
    for key in ("memory_in_use_gib", "profile_peak_gib"):  # per device: the largest
        out[key] = max(v[key] for v in values)
    out["load_seconds"] = max(v["load_seconds"] for v in values)
    # the ranks start side by side: each phase as long as its slowest rank's
    names = dict.fromkeys(k for v in values for k in v["startup"])  # a CPU stage has fewer
    out["startup"] = {k: max(v["startup"].get(k, 0.0) for v in values) for k in names}
    out["cpu_kernels"] = [k for v in values for k in v["cpu_kernels"]]
    out["ranks"] = len(values)
    return out


def _cost_all(values: list[ModelCost], driver: int) -> ModelCost:
    """The whole model's cost: the sum of its parts (the share of experts a token runs is
    each part's, not a sum)."""
    return ModelCost(**{f.name: (max if f.name == "expert_fraction" else sum)(
        getattr(v, f.name) for v in values) for f in dataclasses.fields(ModelCost)})


def _kv_scales_all(values: list[list[tuple[float, float]]], driver: int
                   ) -> list[tuple[float, float]]:
    """The model's layers in stage order (ranks are numbered stage by stage, the driver first
    of the last stage); a layer's scale over its tensor-parallel shards is the largest, as one
    process's over all heads."""
    tp = len(values) - driver
    out = []
    for first in range(0, len(values), tp):
        for shards in zip(*values[first : first + tp], strict=True):
            out.append((max(k for k, _ in shards), max(v for _, v in shards)))
    return out


def _connector_info_all(values: list[dict[str, Any] | None], driver: int
                        ) -> dict[str, Any] | None:
    return merge_info(values) if values[driver] is not None else None


COMBINE: dict[str, Callable[[list[Any], int], Any]] = {
    "describe": _describe_all,
    "model_cost": _cost_all,
    "linear_bytes": lambda values, driver: sum(values),
    "kv_scales": _kv_scales_all,
    "kv_connector_info": _connector_info_all,
}
