"""MoE experts of a GGUF file kept as the file stores them (--quantization gguf on Qwen3-MoE or
Mixtral): each expert's gate, up and down rows as raw blocks (Q4_K, Q6_K, ... per tensor), so
a CPU holds about the file's bytes, where experts dequantized to bfloat16 take 3.5x them
(Qwen3-30B-A3B Q4_K_M: ~17 GB of experts against ~61).

Where they run:
- A CPU engine (loader.prepack_for_cpu), and a GPU engine's experts in host memory
  (--n-cpu-moe, loader.prepack_host_experts): `prepack_cpu` packs each expert's gate-and-up
  rows and its down rows for the integer dot kernel (ops/cpu_intdot.py: the file's codes,
  activations rounded to int8 per 32 as the CPU plan rounds them), stacked over the experts,
  and every batch runs on it, each expert a step touches on its tokens' rows (ops/cpu_moe.py,
  from C++); no dense copy is kept (the memory is the point). Where the kernel is not built or
  a type has no affine integer codes (F16, BF16, F32 experts), the experts are dequantized once
  to the engine dtype.
- Other CPU uses (tools that read the model as loaded, in float32): the raw blocks, the experts
  a step runs dequantized at each call, exactly.
- A GPU: dequantized once after loading to the model dtype, for ops/moe.py's kernels (dense,
  fp8 and MXFP4 experts).
- Tensor parallelism (each rank 1/n of every expert's intermediate size, a down projection's
  columns split inside its blocks): dequantized while loading.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skyline.config import ConfigError
from skyline.ops import cpu_intdot, cpu_moe, cpu_plan
from skyline.ops.dequant import dequantize_ref
from skyline.ops.moe import moe_activation, moe_by_expert
from skyline.quant.experts import PARTS, ExpertLayer, UnquantizedExpertMethod, _bias, _new
from skyline.quant.gguf import PackedGGUF, pack_intdot
from skyline.quant.method import shape_error

Runs = list[tuple[int, torch.Tensor]]  # (ggml type, blocks [E, rows, bytes]) stacked by rows


class GGUFExpertMethod(UnquantizedExpertMethod):
    """Experts as raw GGUF blocks; see the module docstring for where each layout runs."""

    fmt = "gguf"

    def create_weights(self, layer: ExpertLayer) -> None:
        layer.gguf_dtype = torch.get_default_dtype()  # the model's: a dense layout's
        if hasattr(layer, "gguf_experts"):
            del layer.gguf_experts
        if getattr(layer, "i_shard", None) is not None:
            super().create_weights(layer)  # dequantized while loading (hold)
            return
        for proj in PARTS:  # placeholders on the weights' device, carrying the loader
            _new(layer, proj, (0,), proj, torch.uint8)
        layer.gguf_experts = {}  # (expert, part) -> PackedGGUF

    def hold(self, layer: ExpertLayer, loaded: Any, shard_id: Any) -> torch.Tensor | None:
        """Keep one expert's blocks (shard (expert, part)) as loaded; where the layer holds
        dense weights, return them dequantized for the layer to copy."""
        if not isinstance(loaded, PackedGGUF):
            raise ConfigError("--quantization gguf needs a .gguf model; use another method")
        if not hasattr(layer, "gguf_experts"):
            return dequantize_ref(loaded.data, loaded.qtype)
        h, i = layer.hidden_size, layer.intermediate_size
        want = (h, i) if shard_id[1] == "down" else (i, h)
        if (loaded.data.shape[0], loaded.cols) != want:
            raise ConfigError(shape_error((loaded.data.shape[0], loaded.cols), want))
        layer.gguf_experts[shard_id] = loaded
        return None

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:
        held = getattr(layer, "gguf_experts", None)
        if held is None:
            return  # dense already
        del layer.gguf_experts
        start = layer.expert_ids.start
        blocks = {proj: [(held[(start, part)].qtype,
                          _stacked([held[(start + e, part)].data
                                    for e in range(layer.num_experts)]))
                         for part in parts] for proj, parts in PARTS.items()} if held else None
        device = layer.w13.device
        if blocks is None or device.type != "cpu":  # a GPU's layout (on meta: its size)
            _dense(layer, blocks, layer.gguf_dtype, device)
            return
        for proj in PARTS:
            delattr(layer, proj)
        layer.gguf_blocks = blocks

    def prepack_cpu(self, layer: ExpertLayer, dtype: torch.dtype) -> bool:
        """The integer dot kernel's layout of every expert (module docstring), else the experts
        dequantized once to `dtype`. On meta (sizing a CPU engine), the packed experts are
        about the file's bytes, which the memory check counts: nothing is held."""
        w13 = getattr(layer, "w13", None)
        if w13 is not None and w13.is_meta:
            if cpu_intdot.available():
                for proj in PARTS:
                    delattr(layer, proj)
            return True
        blocks = getattr(layer, "gguf_blocks", None)
        if blocks is None:
            return False  # dense (tensor parallelism)
        rounds = cpu_plan.plan().intdot_rounds
        # every expert's rows of a run at once (one call a run, not one an expert and run)
        packed = [pack_intdot([(d.reshape(-1, d.shape[-1]), t) for t, d in blocks[proj]], k,
                              rounds) for proj, k in _inputs(layer).items()]
        del layer.gguf_blocks
        if all(w is not None for w in packed):
            layer.cpu_experts = tuple(_by_expert(w, layer.num_experts, len(blocks[proj]))
                                      for w, proj in zip(packed, PARTS, strict=True))
        else:
            _dense(layer, blocks, dtype, torch.device("cpu"))
        return True

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        packed = getattr(layer, "cpu_experts", None)
        blocks = getattr(layer, "gguf_blocks", None)
        biases = (_bias(layer, "w13"), _bias(layer, "w2"))
        if packed is not None:
            return cpu_moe.moe_intdot(x, topk_weights, topk_ids, *packed, layer.activation,
                                      layer.swiglu_limit, layer.expert_map, biases)
        if blocks is None:
            return super().apply(layer, x, topk_weights, topk_ids)

        def product(e: int, proj: str, rows: torch.Tensor, b: torch.Tensor | None
                    ) -> torch.Tensor:
            w = _expert(blocks[proj], e).to(rows.dtype)
            return F.linear(rows, w, None if b is None else b[e].to(rows.dtype))

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = product(e, "w13", rows, biases[0])
            h = moe_activation(h, layer.activation, layer.swiglu_limit)
            return product(e, "w2", h, biases[1])

        return moe_by_expert(x, topk_weights, topk_ids, layer.num_experts, mlp,
                             layer.expert_map)


def _by_expert(w: cpu_intdot.IntDotWeight, experts: int, runs: int
               ) -> cpu_intdot.IntDotWeight:
    """A weight packed with its rows ordered (run, expert, row), as ops/cpu_moe.py takes it:
    [expert, (run, row), ...] (gate then up rows of each expert)."""

    def order(t: torch.Tensor) -> torch.Tensor:
        return (t.view(runs, experts, -1, t.shape[-1]).transpose(0, 1)
                .reshape(experts, -1, t.shape[-1]).contiguous())

    return w._replace(codes=order(w.codes), scale=order(w.scale), offset=order(w.offset))


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """[E, rows, bytes] of the experts' blocks: a view where they lie one after another in one
    tensor (a layer's experts in the file's memory map: its pages, not a copy of them), else a
    stacked copy."""
    first = parts[0]
    step, base = first.numel(), first.untyped_storage().data_ptr()
    if all(p.is_contiguous() and p.untyped_storage().data_ptr() == base
           and p.storage_offset() == first.storage_offset() + i * step
           for i, p in enumerate(parts)):
        return first.as_strided((len(parts), *first.shape), (step, *first.stride()))
    return torch.stack(parts)


def _inputs(layer: ExpertLayer) -> dict[str, int]:
    return {"w13": layer.hidden_size, "w2": layer.intermediate_size}


def _expert(runs: Runs, e: int) -> torch.Tensor:
    """Expert e's weight [rows, cols] float32 from its runs of blocks."""
    ws = [dequantize_ref(data[e], qtype) for qtype, data in runs]
    return ws[0] if len(ws) == 1 else torch.cat(ws)


def _dense(layer: ExpertLayer, blocks: dict[str, Runs] | None, dtype: torch.dtype,
           device: torch.device) -> None:
    """w13 and w2 as dense stacked Parameters in `dtype` on `device`, one expert dequantized
    at a time (uninitialized without blocks: a model on meta)."""
    h, i = layer.hidden_size, layer.intermediate_size
    for proj, (n, k) in {"w13": (2 * i, h), "w2": (h, i)}.items():
        w = torch.empty(layer.num_experts, n, k, dtype=dtype, device=device)
        if blocks is not None:
            for e in range(layer.num_experts):
                w[e].copy_(_expert(blocks[proj], e))
        if hasattr(layer, proj):
            delattr(layer, proj)
        setattr(layer, proj, nn.Parameter(w, requires_grad=False))
