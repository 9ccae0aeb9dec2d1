"""Llama decoder layers' decode step on the CPU in the fewest Python calls.

A batch-1 CPU decode step of a small model is bound by what Python dispatches: SmolLM2-135M's
30 layers spent more time in module calls, the checks of general-purpose paths and the small
operations between the weight products than in the products themselves. Where every layer
qualifies (`plan`: plain Llama attention and gated MLP, Linears with a CPU decode product,
full causal attention without sinks), a pure decode batch of at most the products' rows, with a
KV cache of the activations' dtype and no hook on any module (`usable`), runs through `run`:
the operations of the modules' CPU paths (ops/norm.py's rms_norm_cpu, ops/rotary.py's
rotary_cpu, ops/kv_write.py's write_kv, ops/cpu_attention.py's decode_attention_cpu, SwiGLU), in
the same order on the same values, with each layer's weights and shapes bound once. Its
results are the modules' bit for bit (tests/model/test_cpu_decode.py).

Where skyline's CPU operations are built (ops/cpu_ext.py) and every product has a native form,
the step runs from C++ (csrc/cpu_decode.cpp's decode_layers: one call a step, no interpreter
between operations): the same products; attention read from the paged cache in place (csrc's
decode_attention, against decode_attention_cpu: float32 sums in another order, within 1e-6);
the operations between them as loops that round to the activations' dtype (bfloat16 or float32,
as the CPU plan picks) where the ATen operations above round, float32 sums in another order (a
last bit that flips a rounding, of the activations or of a product's input, grows through 30
layers to ~1e-3-1e-2; tests/model/test_cpu_decode.py). A product whose dense weight it holds
takes decode batches of any size (the dense weight past its kernel's rows, as the Linear
would).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from skyline.model.forward_ctx import AttentionMetadata
from skyline.model.layers.attention import cpu_gather
from skyline.ops import cpu_ext
from skyline.ops.cpu_attention import decode_attention_cpu
from skyline.ops.kv_write import write_kv
from skyline.ops.norm import rms_norm_cpu
from skyline.ops.rotary import rotary_cpu

Product = Callable[[torch.Tensor], torch.Tensor]
_DTYPES = (torch.bfloat16, torch.float32)  # the activations' dtypes of the CPU plans


class LayerPlan(NamedTuple):
    """One decoder layer's weights and shapes, bound once."""

    norm_in: tuple[torch.Tensor, float]  # input_layernorm (weight, eps)
    qkv: Product
    attn: Any  # layers/attention.Attention: its kv_cache is read at each step (bound late)
    heads: tuple[int, int, int]  # (num_heads, num_kv_heads, head_dim)
    o: Product
    norm_post: tuple[torch.Tensor, float]  # post_attention_layernorm (weight, eps)
    gate_up: Product
    down: Product


class NativeStep(NamedTuple):
    """csrc/cpu_decode.cpp's decode_layers arguments that do not change between steps."""

    norms: list[torch.Tensor]  # per layer: input_layernorm, post_attention_layernorm
    eps: list[float]
    weights: list[torch.Tensor]  # every product's tensors, in order
    # per product: kind, index of its first tensor, a, b, c, the most rows its kernel takes,
    # the index of its dense weight for more rows (-1: none)
    spec: list[int]
    heads: tuple[int, int, int]  # (num_heads, num_kv_heads, head_dim), the same every layer
    scale: float
    rows: int  # the most rows every product takes, its dense weight included


class DecodePlan(NamedTuple):
    layers: tuple[LayerPlan, ...]
    rotary: Any  # layers/rotary.RotaryEmbedding, shared by the layers
    rows: int  # the most rows every product takes
    # the forward (pre-)hook dicts of every module `run` stands in for: a module keeps its
    # dicts for life, so one C-level `any` over them replaces 600 attribute reads a step
    hooks: tuple[dict, ...]
    native: NativeStep | None = None  # where the C++ step runs them


def plan(layers: nn.ModuleList, rotary: Any) -> DecodePlan | None:
    """The plan of Llama decoder layers (the caller checks that their attention and MLP are
    the plain ones), or None where a layer's Linear has no CPU decode product or its attention
    a sliding window or sinks."""
    out, rows, modules, natives = [], 1 << 30, [rotary], []
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        products = [lin.cpu_decode_product() for lin in linears]
        if any(p is None for p in products) or a.attn.sliding_window or a.attn.sinks is not None:
            return None
        rows = min(rows, *(n for _, n, _ in products))
        natives.append([native for _, _, native in products])
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        out.append(LayerPlan((n1.weight, n1.eps), products[0][0], a.attn,
                             (a.attn.num_heads, a.attn.num_kv_heads, a.head_dim),
                             products[1][0], (n2.weight, n2.eps), products[2][0],
                             products[3][0]))
        modules += [layer, a, a.attn, mlp, n1, n2, *linears]
    hooks = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))
    return DecodePlan(tuple(out), rotary, rows, hooks, _native(out, natives))


def _native(layers: list[LayerPlan], natives: list[list[Any]]) -> NativeStep | None:
    """The C++ step's fixed arguments, where the operations are built and the layers share
    their heads and attention scale (every product has a native form by construction)."""
    heads = {lp.heads for lp in layers}
    scales = {lp.attn.scale for lp in layers}
    if len(heads) != 1 or len(scales) != 1 or not cpu_ext.available():
        return None
    norms, eps, weights, spec, rows = [], [], [], [], cpu_ext.ANY_ROWS
    for lp, products in zip(layers, natives, strict=True):
        norms += [lp.norm_in[0], lp.norm_post[0]]
        eps += [float(lp.norm_in[1]), float(lp.norm_post[1])]
        for native in products:
            dense = -1 if native.dense is None else len(weights) + len(native.tensors)
            spec += [native.kind, len(weights), native.a, native.b, native.c, native.rows,
                     dense]
            weights += [*native.tensors, *(() if native.dense is None else (native.dense,))]
            rows = min(rows, native.rows if native.dense is None else cpu_ext.ANY_ROWS)
    return NativeStep(norms, eps, weights, spec, heads.pop(), float(scales.pop()), rows)


def usable(p: DecodePlan, x: torch.Tensor, meta: AttentionMetadata | None) -> bool:
    """Whether `run` computes this forward: a pure decode batch of bfloat16 or float32 rows
    that every product takes (the C++ step's dense weights take any number), the KV cache bound
    in that dtype (so unscaled), and no hook to call."""
    rows = p.rows if p.native is None else p.native.rows
    if meta is None or meta.num_decodes != x.shape[0] or x.shape[0] > rows:
        return False
    cache = p.layers[0].attn.kv_cache
    if cache is None or cache.dtype != x.dtype or x.dtype not in _DTYPES:
        return False
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or any(p.hooks)):
        return False
    return True


def run(p: DecodePlan, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] (the embeddings) through every layer -> (the last MLP's output, the
    residual), as LlamaDecoderLayer's forwards return them."""
    t = x.shape[0]
    cos2, sin2 = p.rotary._operands(positions, x.dtype)
    slots = meta.slot_mapping
    if (n := p.native) is not None:  # the block tables as they are: no gather to build
        lens = meta.seq_lens_tensor
        lens = torch.tensor(meta.seq_lens[:t]) if lens is None else lens[:t]
        return torch.ops.skyline_cpu.decode_layers(
            x, cos2, sin2, n.norms, n.eps, n.weights, n.spec,
            [layer.attn.kv_cache for layer in p.layers], meta.block_tables[:t].long(),
            lens.long(), slots, *n.heads, n.scale)
    gather = cpu_gather(meta, p.layers[0].attn.kv_cache.shape[2])
    residual = None
    for layer in p.layers:
        h, kvh, d = layer.heads
        w, eps = layer.norm_in
        residual = x if residual is None else x + residual  # in the model dtype, as the norm
        qkv = layer.qkv(rms_norm_cpu(residual, w, eps)).view(t, h + 2 * kvh, d)
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        q, k = rotary_cpu(cos2, sin2, q, k)  # in place: k still neighbours v
        attn = layer.attn
        write_kv(k, v, attn.kv_cache, slots)
        o = decode_attention_cpu(q, attn.kv_cache, gather, attn.scale)
        residual = layer.o(o.view(t, h * d)) + residual
        w, eps = layer.norm_post
        gate_up = layer.gate_up(rms_norm_cpu(residual, w, eps))
        gate, up = gate_up.chunk(2, dim=-1)
        x = layer.down(F.silu(gate) * up)
    assert residual is not None
    return x, residual
