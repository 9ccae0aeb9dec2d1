"""The engine's settings resolved one at a time from the user's arguments: "auto" values
(device, dtype, quantization, async scheduling, max_num_seqs) chosen for the device and the
checkpoint, and the checks that give one sentence for a bad value (the KV cache dtype, counts,
KV offload); the model's path (a shipped config, the default model), the EAGLE head and the
draft model of speculative decoding."""

from __future__ import annotations

import os

import torch

from skyline.config import (
    ConfigError,
    ModelArch,
    ModelConfig,
    OffloadConfig,
    QuantConfig,
    parse_size,
)
from skyline.configs import dummy_config_dir
from skyline.engine.args import EngineArgs
from skyline.model.default import default_model_path
from skyline.model.loader import read_model_arch
from skyline.ops import cpu_plan
from skyline.quant.resolve import resolve_quant_config
from skyline.worker.cuda_graph import MAX_GRAPH_BATCH

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
            plan = cpu_plan.plan()
            # bfloat16 weights (a BF16 GGUF file, an unquantized bfloat16 checkpoint) stay
            # bfloat16 where the products are native, and also where they are not but skyline's
            # kernels run them (AVX2: half the bytes of float32, 1.8x its batch-1 decode, as
            # fast at 8 rows; BENCHMARKS.md)
            if model_dtype == "bfloat16" and quant_method in ("none", "gguf") and (
                    plan.dtype == torch.bfloat16
                    or (plan.bf16_rows and not cpu_plan.probe().onednn_bf16)):
                return "bfloat16"
            if load_format == "gguf":
                return _DTYPE_NAMES[plan.dtype]  # a GGUF file as this CPU runs it fastest
            if quant_method in CPU_BF16_KERNEL_FORMATS:
                return "bfloat16"  # the dtype their kernels want (fp32 dequantizes every call)
            return "float32"  # the CPU runs float32 fastest, or the checkpoint is float16
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
