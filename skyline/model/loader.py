"""Find a model's architecture and build it on a device with its weights: safetensors
(single file or sharded), GGUF, or dummy (random values, for speed runs at real scale).

A model is built on the meta device, cut to the rank's part (model/partition.py: its pipeline
stage, its tensor-parallel shards; the whole model in one process), then its parameters are
made on the device and filled from the checkpoint, each rank reading the tensors of its own
stage and keeping its slices."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from skyline.config import ConfigError, ModelArch, ModelConfig
from skyline.model.layers.embedding import LMHead, VocabEmbedding
from skyline.model.layers.linear import Linear, default_weight_loader
from skyline.model.layers.moe import FusedExperts
from skyline.model.layers.norm import RMSNorm
from skyline.model.layers.rotary import RotaryEmbedding, rope_type_of
from skyline.model.partition import partition, weight_names
from skyline.model.registry import get_model_class
from skyline.model.weights import held_bytes
from skyline.ops import cpu_plan, host_memory
from skyline.parallel.groups import ParallelLayout
from skyline.progress import bar
from skyline.quant import attach_quant_methods, finish_loading
from skyline.quant.external import translate
from skyline.quant.method import prepack, unpack

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model_arch(path: str, load_format: str = "auto") -> tuple[ModelArch, str]:
    """The architecture of the model at `path` and the resolved load format.

    `path` is a .gguf file ("gguf"), a HF directory with config.json and *.safetensors
    ("safetensors"), or, with load_format "dummy", any of these, a directory holding only
    config.json, or the name of a shipped config (e.g. "llama-3.1-8b").
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load format {load_format!r} is unknown; use one of {LOAD_FORMATS}")
    p = Path(path)
    if not p.exists():
        from skyline.configs import dummy_config_dir, shipped_config_names

        shipped = dummy_config_dir(path) if load_format == "dummy" else None
        if shipped is None:
            names = ", ".join(shipped_config_names())
            raise ConfigError(
                f"model path {path} does not exist; pass a Hugging Face model directory, "
                f"a .gguf file, or with --load-format dummy a shipped config ({names})"
            )
        p = Path(shipped)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ConfigError(
                f"{path} is neither a .gguf file nor a directory; pass a .gguf file or a "
                "Hugging Face model directory"
            )
        if load_format == "safetensors":
            raise ConfigError(f"{path} is a .gguf file; use --load-format gguf or auto")
        from skyline.model.gguf import read_gguf_hf_config

        arch = _arch_from_hf_config(read_gguf_hf_config(str(p)), str(p))
        return arch, "dummy" if load_format == "dummy" else "gguf"
    if load_format == "gguf":
        raise ConfigError(f"{path} is a directory; --load-format gguf needs a .gguf file")
    config_path = p / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"{path} has no config.json; pass a Hugging Face model directory or a .gguf file"
        )
    try:
        cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {config_path} ({e}); download it again") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{config_path} is not a JSON object; download it again")
    arch = _arch_from_hf_config(cfg, str(config_path))
    if load_format == "dummy":
        return arch, "dummy"
    if any(p.glob("*.safetensors")):
        return arch, "safetensors"
    other = any(p.glob("*.bin")) or any(p.glob("*.pt"))
    hint = " (PyTorch .bin checkpoints are not supported)" if other else ""
    raise ConfigError(
        f"{path} holds no *.safetensors weights{hint}; download the safetensors files, "
        "or pass --load-format dummy for random weights"
    )


def _arch_from_hf_config(cfg: dict[str, Any], source: str) -> ModelArch:
    cfg = _normalize_rope(cfg)
    try:
        return ModelArch.from_hf_config(cfg)
    except KeyError as e:
        field = e.args[0]
        raise ConfigError(f"{source} lacks the field {field!r}; is it a model config?") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{source} has an invalid value ({e}); download it again") from None


def _normalize_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Map transformers>=5 `rope_parameters` onto the `rope_theta` / `rope_scaling` fields
    ModelArch reads (configs saved by transformers 5 carry only the former)."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return cfg  # absent, or per-layer-type parameters (not used by supported models)
    cfg = dict(cfg)
    cfg["rope_theta"] = params["rope_theta"]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    cfg["rope_scaling"] = scaling if rope_type_of(scaling) != "default" else None
    return cfg


def load_model(cfg: ModelConfig, device: torch.device | str,
               layout: ParallelLayout | None = None) -> nn.Module:
    """Build the model of `cfg.arch` in `cfg.dtype` on `device`, then load weights: the whole
    model, or with `layout` this rank's part of it."""
    device = torch.device(device)
    dtype = DTYPES.get(cfg.dtype)
    if dtype is None:
        raise ConfigError(f"dtype {cfg.dtype!r} is not supported; use one of {list(DTYPES)}")
    layout = layout or ParallelLayout.single(cfg.arch.num_layers, str(device))
    model_cls = get_model_class(cfg.arch.architecture)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(cfg.arch)
            attach_quant_methods(model, cfg.quant)  # Linear layouts of the quantized format
            partition(model, layout)
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                m.materialize(device)
                m.extend(cfg.max_model_len)
        materialize(model, device)
    finally:
        torch.set_default_dtype(prev_dtype)
    model.requires_grad_(False)
    model.eval()
    rename = weight_names(model, layout)
    desc = f"loading {cfg.name}"
    with torch.no_grad():
        if cfg.load_format == "dummy":
            fill_dummy_weights(model, cfg.seed)
        elif cfg.load_format == "safetensors":
            # another tool's quantized tensors repacked into skyline's layout as they stream
            tensors = bar(iter_safetensors(cfg.path, rename), desc=desc, unit=" tensors")
            model.load_weights(translate(_renamed(tensors, rename), cfg.quant))
        elif cfg.load_format == "gguf":
            from skyline.model.gguf import head_code_bits, iter_gguf_weights

            packed = cfg.quant.method == "gguf"
            weights = iter_gguf_weights(cfg.path, cfg.arch, packed=packed, want=rename)
            model.load_weights(_renamed(bar(weights, desc=desc, unit=" tensors"), rename))
            bits = head_code_bits(cfg.path)
            for m in model.modules():
                if isinstance(m, LMHead):
                    m.code_bits = bits
        else:
            raise ConfigError(
                f"load format {cfg.load_format!r} is unknown; use safetensors, gguf or dummy"
            )
        finish_loading(model)  # online quantization once every shard is loaded
        if cfg.quant.lm_head:
            for m in model.modules():
                if isinstance(m, LMHead):
                    m.quantize_fp8()
    return model


def _renamed(weights: Iterator[tuple[str, Any]], rename: Callable[[str], str | None]
             ) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        new = rename(name)
        if new is not None:
            yield new, tensor


def materialize(model: nn.Module, device: torch.device) -> None:
    """Real tensors on `device` (uninitialized: loading fills them) for the parameters of a
    model built on the meta device, each once (tied weights stay tied), with their loaders;
    a module with a `weight_device` gets its own tensors there instead.
    A buffer computed at construction must have been rebuilt on the device before."""
    made: dict[int, nn.Parameter] = {}
    layer_device = device
    for module in model.modules():
        # a module may keep its weights elsewhere (experts in host memory: --n-cpu-moe)
        elsewhere = getattr(module, "weight_device", None)
        device = torch.device(elsewhere) if elsewhere is not None else layer_device
        for name, p in module._parameters.items():
            if p is None or not p.is_meta:
                continue
            new = made.get(id(p))
            if new is None:
                # torch.empty, not empty_like: a meta tensor's *_like runs Python reference ops
                new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                   requires_grad=False)
                new.__dict__.update(p.__dict__)  # weight_loader, shard_ids
                made[id(p)] = new
            module._parameters[name] = new
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                raise RuntimeError(f"buffer {name} of {type(module).__name__} was computed on the "
                                   "meta device; rebuild it on the device in load_model")
            if b is not None and b.device != device:  # built on the host at construction
                module._buffers[name] = b.to(device)


def prepack_for_cpu(model: nn.Module, dtype: torch.dtype) -> int:
    """Pack a loaded CPU model's unquantized Linears and LM head for oneDNN
    (`ops/cpu_linear.py`), and let quantized Linears take their serving layout in the model's
    compute `dtype` (a method's `prepack_cpu`: INT4/INT8 in bfloat16 keep only the int4
    kernel's planes): what the engine serves with. Tools that read or save weights (quantize,
    reports) keep the plain layout. Returns how many products were packed."""
    # a GGUF file's head on the integer dot kernel, by the plan: in 8-bit codes (6 where the
    # file holds it in 6 bits or fewer), a 16-bit head too; the entries within 8 of each row's
    # top are recomputed from the dense weight (LMHead.prepack). Whether the Linears keep the
    # file's blocks (a CPU engine) or were dequantized (the CPU stage of a GPU + CPU placement,
    # whose engine resolves formats for the GPU), a CPU holds the same head; only float32 of
    # dequantized blocks (--dtype float32) stays exact.
    gguf = any(getattr(getattr(m, "linear_method", None), "name", None) == "gguf"
               for m in model.modules())
    plan = cpu_plan.plan()
    intdot_rows = plan.intdot_rows if gguf or dtype != torch.float32 else 0
    packed = 0
    for module in model.modules():
        if isinstance(module, Linear):
            hook = getattr(module.linear_method, "prepack_cpu", None)
            packed += hook(module, dtype) if hook is not None else prepack(module, plan.bf16_rows)
        elif isinstance(module, LMHead):
            packed += module.prepack(intdot_rows, plan.intdot_rounds, plan.bf16_rows)
        elif isinstance(module, FusedExperts):
            hook = getattr(module.expert_method, "prepack_cpu", None)
            packed += hook(module, dtype) if hook is not None else 0
    _streamed_into_huge_pages(model)
    return packed


# What a CPU decode step's kernels stream, by module: the bf16 kernel's plain weights, the
# integer dot kernel's codes, the int4 kernel's planes, packed experts
STREAMED = ("bf16_weight", "cpu_bf16", "cpu_intdot", "cpu_planes", "cpu_experts")
ARENA_BYTES = 64 << 20  # weights gathered into one mapping at a time (the copy's extra memory)


def _streamed_into_huge_pages(model: nn.Module) -> None:
    """The weights decode steps stream, in memory of transparent huge pages (ops/host_memory.py),
    a mapping per ~64 MiB of consecutive modules (a small model's layer shares its pages)."""
    items: list[tuple[nn.Module, str]] = []
    held = 0
    # a GGUF layer whose plain bf16 weight is also its dense one (no oneDNN bf16): one copy
    aliased = [m for m in model.modules() if getattr(m, "cpu_dense", None) is not None
               and m.cpu_dense is getattr(m, "cpu_bf16", None)]
    for module in model.modules():
        names = STREAMED if isinstance(module, (Linear, FusedExperts)) else ()
        if isinstance(module, LMHead):
            names = ("intdot_weight",) + (("weight",) if module.bf16_rows else ())
        present = [(module, name) for name in names if getattr(module, name, None) is not None]
        if present:
            items += present
            held += held_bytes([module])  # about: its dense copies count too
        if held >= ARENA_BYTES:
            host_memory.into_huge_pages(items)
            items, held = [], 0
    if items:
        host_memory.into_huge_pages(items)
    for m in aliased:
        m.cpu_dense = m.cpu_bf16


def prepack_host_experts(model: nn.Module, dtype: torch.dtype) -> int:
    """On a GPU engine, give the experts held in host memory (--n-cpu-moe) the CPU's serving
    layout in the model's `dtype` (fp8 dequantized once: no CPU has fp8 units). Returns how
    many were packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, FusedExperts) and module.weight_device == "cpu":
            hook = getattr(module.expert_method, "prepack_cpu", None)
            packed += hook(module, dtype) if hook is not None else 0
    return packed


def plain_layout(model: nn.Module) -> None:
    """Undo prepack_for_cpu for the unquantized Linears and the LM head: their dense weights
    back as Parameters, as load_model left them (bit for bit: oneDNN's layout only reorders
    the values), so the model computes exactly as a freshly loaded one. What tools that read
    or change the weights need (calibration, quantization, the format search); serving goes
    on through F.linear. Quantized Linears keep the layout they serve with."""
    for module in model.modules():
        forget = getattr(module, "forget_cpu_decode_plan", None)
        if forget is not None:  # its decode plan holds the packed products
            forget()
        if isinstance(module, Linear):
            unpack(module)
        elif isinstance(module, LMHead):
            if module.bf16_rows:  # its weight out of the shared huge-page mapping, as loaded
                module.weight.data = module.weight.data.clone()
            module.packed_weight = None
            module.intdot_weight, module.intdot_rows, module.bf16_rows = None, 0, 0


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with no checkpoint: uniform(-1e-3, 1e-3), norm weights 1; quantized
    tensors (MoE experts shipped in MXFP4) as their format's `fill_dummy` makes them. Each
    checkpoint tensor is drawn from a generator of its own name, at its full size, and loaded
    as a checkpoint's would be: every rank of a parallel layout holds the values one process
    would (on the same kind of device). Generated on the parameters' device."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        fill = getattr(getattr(module, "expert_method", None), "fill_dummy", None)
        if fill is not None:
            device = next(module.parameters()).device
            fill(module, torch.Generator(device).manual_seed(
                seed ^ zlib.crc32(prefix.encode())))
        for pname, param in module.named_parameters(prefix, recurse=False):
            if id(param) in seen or param.numel() == 0 or not param.is_floating_point():
                continue  # tied weights; placeholders; integer tensors, filled by their format
            seen.add(id(param))
            if isinstance(module, RMSNorm):
                param.data.fill_(1.0)
                continue
            if getattr(module, "loads_embedding", False):
                pname = "model.embed_tokens.weight"  # an untied head stands for the embedding
            load = getattr(param, "weight_loader", default_weight_loader)
            for shard_id in getattr(param, "shard_ids", (None,)):
                gen = torch.Generator(param.device)
                gen.manual_seed(seed ^ zlib.crc32(f"{pname}/{shard_id}".encode()))
                full = torch.empty(_checkpoint_shape(module, param, shard_id), dtype=param.dtype,
                                   device=param.device)
                load(param, full.uniform_(-1e-3, 1e-3, generator=gen), shard_id)


def _checkpoint_shape(module: nn.Module, param: nn.Parameter, shard_id: Any) -> tuple[int, ...]:
    """The shape of the checkpoint tensor that fills (shard `shard_id` of) `param`."""
    shape = getattr(module, "checkpoint_shape", None)  # a layer that holds a shard
    if shape is not None:
        return shape(param, shard_id)
    if isinstance(module, (VocabEmbedding, LMHead)) and module.vocab_shard is not None:
        return (module.vocab_size, param.shape[1])
    return tuple(param.shape)


def safetensors_files(path: str) -> list[Path]:
    """The checkpoint files of HF directory `path`, following model.safetensors.index.json."""
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"cannot read {index} ({e}); download it again") from None
        files = [p / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{index} lists {f.name}, which is missing; download it")
        return files
    if (p / "model.safetensors").is_file():
        return [p / "model.safetensors"]
    # Skip Mistral's native-format duplicate of the weights.
    files = sorted(f for f in p.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise ConfigError(f"{path} holds no *.safetensors weights; download them")
    return files


def iter_safetensors(path: str, want: Callable[[str], Any] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of the checkpoint (that `want` is true of), one
    tensor in memory at a time; the caller copies each into its parameter."""
    files = safetensors_files(path)
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
            names = list(handle.keys())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ConfigError(
                f"cannot read {file} ({e}); it is truncated or corrupt, download it again"
            ) from None
        for name in names:
            if want is not None and not want(name):
                continue
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ConfigError(
                    f"cannot read tensor {name} from {file} ({e}); the file is truncated or "
                    "corrupt, download it again"
                ) from None
            yield name, tensor
