"""Resolve user-facing engine arguments ("auto" values included) into a frozen EngineConfig."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from skyline.config import (
    EXECUTORS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    FleetConfig,
    ModelArch,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
    SpecConfig,
    parse_size,
)
from skyline.configs import dummy_config_dir
from skyline.engine.args import EngineArgs
from skyline.model.default import default_model_path
from skyline.model.loader import read_model_arch
from skyline.ops import cpu_plan
from skyline.parallel.placement import (
    Stage,
    even_stages,
    format_stages,
    parse_placement,
    plan_stages,
)
from skyline.parallel.shard import even_shard, head_shard
from skyline.quant.resolve import resolve_quant_config
from skyline.worker.cuda_graph import MAX_GRAPH_BATCH

log = logging.getLogger(__name__)


CPU_MAX_NUM_SEQS = 64  # max_num_seqs "auto" on the CPU

_DTYPE_ALIASES = {
    "float": "float32", "fp32": "float32", "float32": "float32",
    "half": "float16", "fp16": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}


def _resolve_async(value: str | bool, device: str) -> bool:
    if isinstance(value, bool):
        return value
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"--async-scheduling must be auto, on or off, got {value!r}")
    # On a CPU the forward pass runs on the host anyway: nothing to overlap.
    return value == "on" or (value == "auto" and device.startswith("cuda"))


def resolve_device(device: str) -> str:
    """The device an engine of `--device` runs on ("auto": a GPU if one is visible)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible; "
                          "use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    return device


# Weight formats whose fast CPU path (torch's int4 kernel) needs bfloat16 activations.
CPU_BF16_KERNEL_FORMATS = ("int4", "int8", "mxfp4")


def _resolve_dtype(dtype: str, device: str, model_dtype: str | None, load_format: str,
                   quant_method: str) -> str:
    if dtype == "auto":
        if device == "cpu":
            if load_format == "gguf":
                # A GGUF file is served as this CPU runs it fastest (ops/cpu_plan.py:
                # bfloat16 where its products are native).
                return _DTYPE_NAMES[cpu_plan.plan().dtype]
            if quant_method in CPU_BF16_KERNEL_FORMATS:
                return "bfloat16"  # the dtype their kernels want (fp32 dequantizes every call)
            return "float32"  # CPUs without bf16 units run fp32 fastest, and exactly
        return model_dtype if model_dtype in ("bfloat16", "float16") else "bfloat16"
    if dtype not in _DTYPE_ALIASES:
        raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPE_ALIASES[dtype]


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _resolve_quant(args: EngineArgs, path: str, fmt: str, device: str) -> QuantConfig:
    """The checkpoint's own format unless --quantization says otherwise; on a CPU with no
    --dtype either, a GGUF file keeps its blocks packed where this CPU's plan runs them on
    the int4 kernel (quant/gguf.py). An explicit --dtype float32 is the exact path: blocks
    dequantized to float32 at load."""
    method = args.quantization
    if (method in (None, "auto") and device == "cpu" and fmt == "gguf"
            and args.dtype == "auto" and cpu_plan.plan().gguf_packed):
        method = "gguf"
    return resolve_quant_config(method, args.quant_group_size, path, fmt)


def _resolve_kv_cache_dtype(kv_dtype: str, device: str) -> str:
    resolved = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}.get(kv_dtype)
    if resolved is None:
        raise ConfigError(f"--kv-cache-dtype must be auto or fp8 (alias fp8_e4m3), "
                          f"got {kv_dtype!r}")
    # Triton converts float8_e4m3fn only on compute capability 8.9+ (Ada, Hopper, Blackwell).
    if resolved != "auto" and device.startswith("cuda") and \
            torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError("--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or "
                          "newer; use --kv-cache-dtype auto on this one")
    return resolved


def _resolve_spec_model(args: EngineArgs, arch: ModelArch) -> str | None:
    """The EAGLE head's directory, checked against the target's shape."""
    if args.speculative_method != "eagle":
        return args.speculative_model
    from skyline.worker.spec.eagle import check_head, default_head_dir

    path = args.speculative_model
    if path is None and args.model is None:
        path = default_head_dir()
    if path is not None:
        check_head(path, arch)
    return path


def _resolve_draft(args: EngineArgs, target: ModelConfig) -> ModelConfig | None:
    """The draft model's config: same device dtype and context as the target, its own
    checkpoint format; its vocabulary must be the target's."""
    if args.speculative_method != "draft":
        return None
    n = args.speculative_draft_layers
    if args.speculative_model is None:
        if n > target.arch.num_layers:
            raise ConfigError(f"--speculative-draft-layers {n} is more than the target's "
                              f"{target.arch.num_layers} layers; use fewer")
        return None
    if n:
        raise ConfigError("give --speculative-model or --speculative-draft-layers, not both")
    # A dummy target (random weights, speed runs) gets a dummy draft.
    fmt = "dummy" if target.load_format == "dummy" else "auto"
    path = resolve_model_path(args.speculative_model, fmt)
    if dummy_config_dir(args.speculative_model) == path:
        fmt = "dummy"
    arch, fmt = read_model_arch(path, fmt)
    check_draft_vocab(arch, target.arch, path)
    quant = resolve_quant_config(None, args.quant_group_size, path, fmt)
    return ModelConfig(path=path, load_format=fmt, arch=arch, dtype=target.dtype,
                       max_model_len=target.max_model_len, seed=target.seed,
                       name=os.path.basename(os.path.normpath(path)), quant=quant)


def check_draft_vocab(draft: ModelArch, target: ModelArch, path: str) -> None:
    """A draft must share the target's tokenizer: same vocabulary size and special tokens."""
    what = None
    if draft.vocab_size != target.vocab_size:
        what = f"vocab_size {draft.vocab_size}, the target's is {target.vocab_size}"
    elif None not in (draft.bos_token_id, target.bos_token_id) and \
            draft.bos_token_id != target.bos_token_id:
        what = f"bos_token_id {draft.bos_token_id}, the target's is {target.bos_token_id}"
    elif draft.eos_token_ids and target.eos_token_ids and \
            not set(draft.eos_token_ids) & set(target.eos_token_ids):
        what = f"eos_token_id {list(draft.eos_token_ids)}, the target's is " \
               f"{list(target.eos_token_ids)}"
    if what is not None:
        raise ConfigError(f"the draft model {path} has {what}; a draft model must use the "
                          "target's tokenizer: pick a smaller model of the same family")


def resolve_model_path(model: str | None, load_format: str) -> str:
    if model is None:
        return default_model_path()
    if not os.path.exists(model):
        shipped = dummy_config_dir(model)
        if shipped is not None:
            if load_format not in ("auto", "dummy"):
                raise ConfigError(f"{model!r} is a shipped config; it needs --load-format dummy")
            return shipped
        raise ConfigError(
            f"model {model!r} not found; give a HF model directory, a .gguf file, or a shipped "
            "config name with --load-format dummy"
        )
    return model


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


def _resolve_max_num_seqs(value: int | str | None, on_gpu: bool) -> tuple[int, bool]:
    """(max_num_seqs, chosen by the runner): "auto" on a GPU lets the runner choose up to the
    largest CUDA-graph batch once the KV cache is sized; on the CPU it is 64."""
    if value is None or value == "auto":
        return (MAX_GRAPH_BATCH, True) if on_gpu else (CPU_MAX_NUM_SEQS, False)
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--max-num-seqs takes a number or auto, got {value!r}") from None
    if n < 1:
        raise ConfigError("--max-num-seqs must be at least 1")
    return n, False


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
                            max_model_len=max_len, max_waiting=args.max_waiting)
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


def _check_counts(args: EngineArgs) -> None:
    """Counts a caller of the Python API may set to 0 or less (the CLI's flags refuse them)."""
    for name in ("max_model_len", "max_num_batched_tokens", "num_blocks", "threads",
                 "block_size", "num_speculative_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be at least 1, got {value}")


def _resolve_offload(args: EngineArgs) -> OffloadConfig:
    disk = args.kv_offload_disk or None
    if disk is not None:
        disk = os.path.abspath(os.path.expanduser(disk))
        if os.path.exists(disk) and not os.path.isdir(disk):
            raise ConfigError(f"--kv-offload-disk {disk} is a file; give a directory")
    size = args.kv_offload_disk_size
    if size is not None and disk is None:
        raise ConfigError("--kv-offload-disk-size needs --kv-offload-disk DIR")
    return OffloadConfig(ram_bytes=parse_size(args.kv_offload_ram), disk_dir=disk,
                         disk_bytes=None if size is None else parse_size(size),
                         policy=args.kv_offload_policy, dtype=args.kv_offload_dtype)
