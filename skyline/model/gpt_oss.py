"""gpt-oss (GptOssForCausalLM): attention with biases, a learned sink logit per head and
sliding-window layers alternating with full ones (ModelArch.sliding_windows, from
`layer_types`), YaRN rope; a sparse block on every layer whose router has a bias and takes a
softmax over the top-k logits, and whose experts have biases and gpt-oss's own gated
activation (gate clamped at `swiglu_limit`, gate * sigmoid(1.702 gate) * (up + 1)).

Its checkpoints store each layer's experts stacked: `mlp.experts.gate_up_proj` [E, H, 2I] with
gate and up interleaved along the last dim (columns 2i and 2i + 1) and `down_proj` [E, I, H],
inputs first, or in MXFP4 as `*_blocks` [E, rows, K / 32, 16] and `*_scales` [E, rows, K / 32]
with rows the outputs (gate and up interleaved likewise); biases [E, 2I] and [E, H].
`load_weights` hands them over per expert, gate and up de-interleaved, under the shared names
(layers/moe.py), so the experts' format (quant/experts.py) needs nothing of gpt-oss.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from skyline.config import ModelArch
from skyline.model.layers.moe import MoE
from skyline.model.llama import LlamaAttention, LlamaForCausalLM

_STACKED = re.compile(r"^(.*\.experts)\.(gate_up|down)_proj(_bias|_blocks|_scales)?$")
_KIND = {"": "weight", "_bias": "bias", "_blocks": "blocks", "_scales": "scales"}


class GptOssAttention(LlamaAttention):
    sinks = True


def per_expert(weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked expert tensors as per-expert ones (`experts.<e>.<part>_proj.<kind>`,
    rows = outputs), gate and up de-interleaved; other tensors pass through."""
    for name, t in weights:
        m = _STACKED.match(name)
        if m is None:
            yield name, t
            continue
        prefix, proj, suffix = m.group(1), m.group(2), m.group(3) or ""
        kind = _KIND[suffix]
        for e in range(t.shape[0]):
            w = t[e]
            if kind == "weight":  # dense: [in, out]
                w = w.t()
            if proj == "down":
                yield f"{prefix}.{e}.down_proj.{kind}", w
            else:  # outputs 2i (gate) and 2i + 1 (up)
                yield f"{prefix}.{e}.gate_proj.{kind}", w[0::2]
                yield f"{prefix}.{e}.up_proj.{kind}", w[1::2]


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention
    renames = (
        (r"\.mlp\.router\.", ".mlp.gate."),
        (r"\.self_attn\.sinks$", ".self_attn.attn.sinks"),
    )

    @staticmethod
    def make_mlp(arch: ModelArch, layer: int) -> nn.Module:
        return MoE(arch.hidden_size, arch.moe_intermediate_size, arch.num_experts,
                   arch.num_experts_per_tok, "topk_softmax", bias=True, router_bias=True,
                   activation="swiglu_oai", swiglu_limit=arch.swiglu_limit)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert(weights))
