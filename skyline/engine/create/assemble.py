"""The EngineConfig put together from the resolved settings (resolve.py, parallel.py): the
model, cache, scheduler, speculation, fleet, parallel and offload configs, and the torch
threads of the engine's process."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from skyline.config import (
    CacheConfig,
    EngineConfig,
    FleetConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
    parse_size,
)
from skyline.configs import dummy_config_dir
from skyline.engine.args import EngineArgs
from skyline.engine.create.parallel import _placement_device, _resolve_parallel
from skyline.engine.create.resolve import (
    CPU_BF16_KERNEL_FORMATS,
    _check_counts,
    _resolve_async,
    _resolve_draft,
    _resolve_dtype,
    _resolve_kv_cache_dtype,
    _resolve_max_num_seqs,
    _resolve_offload,
    _resolve_quant,
    _resolve_spec_model,
    resolve_device,
    resolve_model_path,
)
from skyline.model.loader import read_model_arch
from skyline.ops import cpu_plan

# One logger for the whole package (the name its messages always had).
log = logging.getLogger("skyline.engine.create")


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, bool]:
    """Returns the config and whether max_model_len was left to "auto"."""
    _check_counts(args)
    path = resolve_model_path(args.model, args.load_format)
    if args.model is not None and dummy_config_dir(args.model) == path:
        args.load_format = "dummy"
    arch, fmt = read_model_arch(path, args.load_format)
    device = _placement_device(args, arch) or resolve_device(args.device)
    quant = _resolve_quant(args, path, fmt, device)
    dtype = _resolve_dtype(args.dtype, device, arch.torch_dtype, fmt, quant.method)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device == "cpu" and (threads := cpu_plan.plan().threads):
        torch.set_num_threads(threads)  # measured on this CPU by `skyline tune`
    elif device.startswith("cuda") and not args.n_cpu_moe:
        # A GPU engine's host work is many small CPU ops; a team of threads per op costs more
        # than it saves and competes with the API processes (served on an H200: offline
        # 15.0k -> 19.9k tok/s at 256 sequences, TTFT p50 539 -> 208 ms). Host experts
        # (--n-cpu-moe) keep every core.
        torch.set_num_threads(1)
    auto_len = args.max_model_len is None
    max_len = args.max_model_len or arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        log.warning("--max-model-len %d is beyond the model's trained context of %d tokens; "
                    "quality past it is not guaranteed", max_len, arch.max_position_embeddings)
    on_gpu = device.startswith("cuda")
    max_seqs, seqs_auto = _resolve_max_num_seqs(args.max_num_seqs, on_gpu)
    budget = args.max_num_batched_tokens or (8192 if on_gpu else 1024)
    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    if device == "cpu" and dtype == "float32" and quant.method in CPU_BF16_KERNEL_FORMATS:
        log.warning("%s weights on the CPU in float32 (--dtype float32) dequantize every layer "
                    "at every call; --dtype auto or bfloat16 runs them on torch's int4 kernel, "
                    "several times faster (BENCHMARKS.md)", quant.method)
    if args.quantize_lm_head:
        quant = dataclasses.replace(quant, lm_head=True)
    model_cfg = ModelConfig(path=path, load_format=fmt, arch=arch, dtype=dtype,
                            max_model_len=max_len, seed=args.seed, name=name, quant=quant)
    cache = CacheConfig(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=parse_size(args.kv_cache_memory),
        num_blocks=args.num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_dtype=_resolve_kv_cache_dtype(args.kv_cache_dtype, device),
        kv_events=args.kv_events_port is not None,
    )
    fleet = FleetConfig(role=args.role, kv_events_host=args.kv_events_host,
                        kv_events_port=args.kv_events_port,
                        kv_transfer_port=args.kv_transfer_port)
    sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_seqs_auto=seqs_auto,
                            max_num_batched_tokens=budget,
                            max_model_len=max_len, max_waiting=args.max_waiting,
                            schedule_conservativeness=args.schedule_conservativeness)
    spec = SpecConfig(
        method=args.speculative_method,
        model=_resolve_spec_model(args, arch),
        draft=_resolve_draft(args, model_cfg),
        draft_layers=args.speculative_draft_layers,
        eagle_lookup=args.eagle_lookup,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        # Where a step stops being memory-bound, and what one more query token costs: a few
        # barely change a decode step's time on a GPU or (oneDNN-packed weights) on a CPU; the
        # price is mostly the proposer's own step, small for the EAGLE head in bfloat16 (chat
        # on the default model: 1.43x at 0.1, 1.53x at 0.02; BENCHMARKS.md).
        max_batch_tokens=args.speculative_max_batch_tokens or (256 if on_gpu else 16),
        draft_cost=0.1 if on_gpu else 0.02,
        gate=args.speculative_gate,
    )
    parallel = _resolve_parallel(args, model_cfg, cache, device, spec.enabled, fleet.role)
    # Expert parallelism reads its token counts on the host, and experts in host memory run on
    # the CPU: neither can be captured in a CUDA graph.
    eager = args.enforce_eager or parallel.expert_parallel or parallel.n_cpu_moe > 0
    return EngineConfig(model=model_cfg, cache=cache, scheduler=sched, device=device,
                        enforce_eager=eager, spec=spec,
                        async_scheduling=_resolve_async(args.async_scheduling, device),
                        parallel=parallel, offload=_resolve_offload(args),
                        fleet=fleet), auto_len

