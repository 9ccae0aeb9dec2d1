"""The engine's parallel layout: the pipeline stages (even, an explicit --placement, or
--placement auto from measured device budgets) and the tensor / expert parallel sizes, checked
against the model once here so that a bad size fails before any process starts."""

from __future__ import annotations

import logging

import torch

from skyline.config import (
    EXECUTORS,
    CacheConfig,
    ConfigError,
    ModelArch,
    ModelConfig,
    ParallelConfig,
)
from skyline.engine.args import EngineArgs
from skyline.parallel.placement import (
    Stage,
    even_stages,
    format_stages,
    parse_placement,
    plan_stages,
)
from skyline.parallel.shard import even_shard, head_shard

# One logger for the whole package (the name its messages always had).
log = logging.getLogger("skyline.engine.create")


def _placement_device(args: EngineArgs, arch: ModelArch) -> str | None:
    """The device an explicit --placement implies for the engine's defaults: cuda if a stage
    is on a GPU (which must be visible), else cpu; None without one."""
    if not args.placement or args.placement == "auto":
        return None
    stages = parse_placement(args.placement, arch.num_layers)
    gpus = [int(s.device[5:]) for s in stages if s.device != "cpu"]
    if gpus and max(gpus) >= torch.cuda.device_count():
        raise ConfigError(f"--placement uses cuda:{max(gpus)} but "
                          f"{torch.cuda.device_count()} GPU(s) are visible")
    return "cuda" if gpus else "cpu"


def _resolve_stages(args: EngineArgs, model: ModelConfig, cache: CacheConfig,
                    device: str) -> list[Stage]:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigError("--tensor-parallel-size and --pipeline-parallel-size must be at "
                          "least 1")
    num_layers = model.arch.num_layers
    if not args.placement:
        # A stage's ranks on a GPU take the GPU of their local rank.
        kind = "cpu" if device == "cpu" else "cuda"
        per_node = tp * pp // max(args.nnodes, 1)
        if kind == "cuda" and per_node > 1 and per_node > torch.cuda.device_count():
            raise ConfigError(f"{per_node} ranks a host need as many GPUs; "
                              f"{torch.cuda.device_count()} are visible")
        return even_stages(num_layers, [device if tp * pp == 1 else kind] * pp)
    if tp > 1 or pp > 1:
        raise ConfigError("--placement gives the pipeline stages and their devices itself; "
                          "drop --tensor-parallel-size and --pipeline-parallel-size")
    if args.placement != "auto":
        return parse_placement(args.placement, num_layers)
    from skyline.worker.probe import device_budgets

    devices = ["cpu"] if device == "cpu" else \
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] + ["cpu"]
    budgets, layer_bytes, first, last = device_budgets(model, cache, devices,
                                                       model.max_model_len)
    stages = plan_stages(num_layers, budgets, layer_bytes, first, last)
    log.info("--placement auto: %s (per layer: %s)", format_stages(stages),
             ", ".join(f"{b.device} {b.seconds_per_layer * 1e3:.2f} ms" for b in budgets))
    return stages


def _resolve_parallel(args: EngineArgs, model: ModelConfig, cache: CacheConfig, device: str,
                      spec: bool, role: str) -> ParallelConfig:
    """The stages, checked against the model: every split the layers will make, made once
    here so that a bad size fails before any process starts."""
    stages = _resolve_stages(args, model, cache, device)
    tp = args.tensor_parallel_size
    world = tp * len(stages)
    arch = model.arch
    # A flag that would do nothing is refused: the user expects it to change the placement
    if (args.expert_parallel or args.n_cpu_moe) and not arch.num_experts:
        flag = "--expert-parallel" if args.expert_parallel else f"--n-cpu-moe {args.n_cpu_moe}"
        raise ConfigError(f"{flag} places the experts of a mixture-of-experts model, and "
                          f"{model.name} has none; drop {flag.split()[0]}")
    if args.expert_parallel and tp == 1:
        raise ConfigError("--expert-parallel shares the experts among a stage's tensor-parallel "
                          "ranks, and --tensor-parallel-size is 1; set it to 2 or more, or drop "
                          "--expert-parallel")
    expert_parallel = args.expert_parallel and tp > 1 and bool(arch.num_experts)
    for r in range(tp if tp > 1 else 0):
        head_shard(arch.num_heads, arch.num_kv_heads, tp, r)
        if not arch.num_experts:
            even_shard(arch.intermediate_size, tp, r, "intermediate size")
        elif not expert_parallel:  # every rank holds a slice of every expert
            even_shard(arch.moe_intermediate_size, tp, r, "experts' intermediate size")
    if expert_parallel and arch.num_experts < tp:
        raise ConfigError(f"{arch.num_experts} experts cannot be shared by "
                          f"--tensor-parallel-size {tp} with --expert-parallel (each rank "
                          "holds whole experts); drop --expert-parallel")
    if args.n_cpu_moe and tp > 1:
        raise ConfigError("--n-cpu-moe runs with one rank per stage; drop "
                          "--tensor-parallel-size or --n-cpu-moe")
    if world > 1 and role != "both":
        raise ConfigError(f"a {role} replica runs on one rank; drop --role or the parallel "
                          "sizes")
    if world > 1 and spec:
        raise ConfigError("speculative decoding does not run with tensor or pipeline "
                          "parallelism yet; drop --speculative-method or the parallel sizes")
    executor = args.distributed_executor
    if executor == "auto":
        executor = "mp" if world > 1 else "uni"
    if executor not in EXECUTORS:
        raise ConfigError(f"--distributed-executor must be auto, uni or mp, got {executor!r}")
    if world > 1 and executor == "uni":
        raise ConfigError(f"{world} ranks need a process each; drop --distributed-executor uni")
    return ParallelConfig(
        tensor_parallel_size=tp,
        stages=tuple((s.device, s.start, s.end) for s in stages),
        executor=executor, distributed_init=args.distributed_init, nnodes=args.nnodes,
        node_rank=args.node_rank, timeout_s=args.distributed_timeout, threads=args.threads,
        expert_parallel=expert_parallel,
        n_cpu_moe=min(args.n_cpu_moe, arch.num_layers) if arch.num_experts else 0)

