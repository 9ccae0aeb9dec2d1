"""Llama decoder layers' decode step on the CPU in the fewest Python calls.

A batch-1 CPU decode step of a small model is bound by what Python dispatches: SmolLM2-135M's
30 layers spent more time in module calls, the checks of general-purpose paths and the small
operations between the weight products than in the products themselves. Where every layer
(of a pipeline stage, every layer it holds) qualifies (`plan`: Llama attention, with Qwen3's
per-head q and k norms or without, full causal and without sinks; a gated MLP, or an MoE block
whose experts the integer dot kernel holds and whose router is a softmax over all experts;
Linears with a CPU decode product), a pure decode batch of at most the products' rows, with a
KV cache of the activations' dtype and no hook on any module (`usable`), runs through `run`:
the operations of the modules' CPU paths (ops/norm.py's rms_norm_cpu, ops/rotary.py's
rotary_cpu, ops/kv_write.py's write_kv, ops/cpu_attention.py's decode_attention_cpu, SwiGLU; an
MoE block is its module), in the same order on the same values, with each layer's weights and
shapes bound once. Its results are the modules' bit for bit (tests/model/test_cpu_decode.py).

Where skyline's CPU operations are built (ops/cpu_ext.py) and every product has a native form,
the step runs from C++ (csrc/cpu_decode.cpp's decode_layers: one call a step, no interpreter
between operations): the same products; attention read from the paged cache in place (csrc's
decode_attention, against decode_attention_cpu: float32 sums in another order, within 1e-6);
an MoE block's router through the ATen operations of ops/moe_route.py's route_ref and its experts
through csrc/cpu_moe.cpp's moe_intdot; the operations between them as loops that round to the
activations' dtype (bfloat16 or float32, as the CPU plan picks) where the ATen operations above
round, float32 sums in another order (a last bit that flips a rounding, of the activations or
of a product's input, grows through 30 layers to ~1e-3-1e-2; tests/model/test_cpu_decode.py).
A product whose dense weight it holds takes decode batches of any size (the dense weight past
its kernel's rows, as the Linear would).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from skyline.model.forward_ctx import AttentionMetadata
from skyline.model.layers.attention import cpu_gather
from skyline.model.layers.moe import MoE
from skyline.ops import cpu_ext
from skyline.ops.cpu_attention import decode_attention_cpu
from skyline.ops.kv_write import write_kv
from skyline.ops.norm import rms_norm_cpu
from skyline.ops.rotary import rotary_cpu
from skyline.parallel.experts import ExpertPlacement

Product = Callable[[torch.Tensor], torch.Tensor]
_DTYPES = (torch.bfloat16, torch.float32)  # the activations' dtypes of the CPU plans


class LayerPlan(NamedTuple):
    """One decoder layer's weights and shapes, bound once."""

    norm_in: tuple[torch.Tensor, float]  # input_layernorm (weight, eps)
    qkv: Product
    # Qwen3's per-head norms of q and of k, each (weight, eps)
    qk_norm: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None
    attn: Any  # layers/attention.Attention: its kv_cache is read at each step (bound late)
    heads: tuple[int, int, int]  # (num_heads, num_kv_heads, head_dim)
    o: Product
    norm_post: tuple[torch.Tensor, float]  # post_attention_layernorm (weight, eps)
    mlp: Product  # a gated MLP's gate_up and down, or an MoE block (the module)


class NativeStep(NamedTuple):
    """csrc/cpu_decode.cpp's decode_layers arguments that do not change between steps."""

    norms: list[torch.Tensor]  # every norm's weight (per layer: input, post-attention, q, k)
    eps: list[float]  # each norm's
    weights: list[torch.Tensor]  # every product's tensors, routers' and experts' in order
    # per product: kind, index of its first tensor, a, b, c, the most rows its kernel takes,
    # the index of its dense weight for more rows (-1: none)
    spec: list[int]
    layer_spec: list[int]  # per layer: where its norms, products, router and experts are
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


class _Gated(NamedTuple):
    """A gated MLP's products: down(SiLU(gate) * up)."""

    gate_up: Product
    down: Product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _moe_experts(moe: nn.Module) -> Any:
    """The integer dot kernel's stacked (w13, w2) of an MoE block that the C++ step computes
    as its module does (a softmax router without bias, SwiGLU experts without biases, every
    expert held here), else None."""
    experts, router = moe.experts, moe.gate
    packed = getattr(experts, "cpu_experts", None)
    if (packed is None or router.bias is not None or router.scoring == "topk_softmax"
            or experts.activation != "silu" or experts.bias or experts.expert_map is not None
            or type(experts.placement) is not ExpertPlacement):
        return None
    return packed


def plan(layers: Sequence[nn.Module], rotary: Any) -> DecodePlan | None:
    """The plan of Llama decoder layers (the caller checks that their attention, MLP or MoE
    block are the plain ones), or None where a layer's Linear has no CPU decode product, its
    attention a sliding window or sinks, or its MoE block experts the step does not run."""
    out, rows, modules, natives = [], 1 << 30, [rotary], []
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        moe = isinstance(mlp, MoE)
        linears = [a.qkv_proj, a.o_proj] + ([] if moe else [mlp.gate_up_proj, mlp.down_proj])
        products = [lin.cpu_decode_product() for lin in linears]
        if (any(p is None for p in products) or a.attn.sliding_window
                or a.attn.sinks is not None or (moe and _moe_experts(mlp) is None)):
            return None
        rows = min(rows, *(n for _, n, _ in products))
        natives.append([native for _, _, native in products])
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        qk = ((a.q_norm.weight, a.q_norm.eps), (a.k_norm.weight, a.k_norm.eps)) if a.qk_norm \
            else None
        out.append(LayerPlan((n1.weight, n1.eps), products[0][0], qk, a.attn,
                             (a.attn.num_heads, a.attn.num_kv_heads, a.head_dim),
                             products[1][0], (n2.weight, n2.eps),
                             mlp if moe else _Gated(products[2][0], products[3][0])))
        modules += [layer, a, a.attn, mlp, n1, n2, *linears]
        modules += [a.q_norm, a.k_norm] if a.qk_norm else []
        modules += [mlp.gate, mlp.experts] if moe else []
    hooks = tuple(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks))
    return DecodePlan(tuple(out), rotary, rows, hooks, _native(out, natives))


def _native(layers: list[LayerPlan], natives: list[list[Any]]) -> NativeStep | None:
    """The C++ step's fixed arguments, where the operations are built and the layers share
    their heads and attention scale (every product has a native form by construction)."""
    heads = {lp.heads for lp in layers}
    scales = {lp.attn.scale for lp in layers}
    if len(heads) != 1 or len(scales) != 1 or not cpu_ext.available():
        return None
    norms: list[torch.Tensor] = []
    eps: list[float] = []
    weights: list[torch.Tensor] = []
    spec: list[int] = []
    layer_spec: list[int] = []
    rows, count = cpu_ext.ANY_ROWS, 0  # (count: the products so far)

    def norm(w: torch.Tensor, e: float) -> int:
        norms.append(w)
        eps.append(float(e))
        return len(norms) - 1

    for lp, products in zip(layers, natives, strict=True):
        entry = [norm(*lp.norm_in), norm(*lp.norm_post), -1, -1, count]
        count += len(products)
        if lp.qk_norm is not None:
            entry[2:4] = [norm(*lp.qk_norm[0]), norm(*lp.qk_norm[1])]
        for native in products:
            dense = -1 if native.dense is None else len(weights) + len(native.tensors)
            spec += [native.kind, len(weights), native.a, native.b, native.c, native.rows,
                     dense]
            weights += [*native.tensors, *(() if native.dense is None else (native.dense,))]
            rows = min(rows, native.rows if native.dense is None else cpu_ext.ANY_ROWS)
        if isinstance(lp.mlp, MoE):
            w13, w2 = _moe_experts(lp.mlp)
            router = lp.mlp.gate
            entry += [len(weights), router.top_k, int(router.scoring == "softmax_renorm"),
                      len(weights) + 1, w13.bits, w13.group, w2.bits, w2.group, w13.rounds]
            weights += [router.weight, w13.codes, w13.scale, w13.offset, w2.codes, w2.scale,
                        w2.offset]
        else:
            entry += [-1] + [0] * 8
        layer_spec += entry
    return NativeStep(norms, eps, weights, spec, layer_spec, heads.pop(), float(scales.pop()),
                      rows)


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
            x, cos2, sin2, n.norms, n.eps, n.weights, n.spec, n.layer_spec,
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
        if layer.qk_norm is not None:  # as Qwen3Attention.position_qk on the CPU
            (wq, eq), (wk, ek) = layer.qk_norm
            q, k = rms_norm_cpu(q, wq, eq), rms_norm_cpu(k, wk, ek)
        q, k = rotary_cpu(cos2, sin2, q, k)  # in place if unnormed: k still neighbours v
        attn = layer.attn
        write_kv(k, v, attn.kv_cache, slots)
        o = decode_attention_cpu(q, attn.kv_cache, gather, attn.scale)
        residual = layer.o(o.view(t, h * d)) + residual
        w, eps = layer.norm_post
        x = layer.mlp(rms_norm_cpu(residual, w, eps))
    assert residual is not None
    return x, residual
