"""A rank's part of a model: the layers of its pipeline stage and the shards of its
tensor-parallel layers, cut from a model built on the meta device before any weight exists.

Every supported architecture has Hugging Face's skeleton (`model.embed_tokens`,
`model.layers`, `model.norm`, `lm_head`): a stage keeps its layers and stands stubs
(layers/stage.py) in for the rest; the embedding runs on the first stage, the norm and head on
the last. Then every module that owns a shard (a method `shard(layout)`: Linears, embeddings,
attention, experts) keeps its part; with --n-cpu-moe the experts of the model's first MoE
layers move to host memory. Checkpoint tensors of other stages are never read.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

from skyline.model.layers.attention import Attention
from skyline.model.layers.stage import NoHead, SkipLayer, StageInput, StageOutput
from skyline.parallel.groups import ParallelLayout

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def partition(model: nn.Module, layout: ParallelLayout) -> None:
    """Cut `model` (on the meta device) down to this rank's part."""
    inner = model.model
    stage = layout.stage
    if layout.num_stages > 1:
        for i in range(len(inner.layers)):
            if not stage.start <= i < stage.end:
                inner.layers[i] = SkipLayer()
        if not layout.last:
            inner.norm = StageOutput()
            model.lm_head = NoHead()
        elif not layout.first and model.lm_head.tied:
            model.lm_head.untie()  # loads the embedding, which lives on the first stage
        if not layout.first:
            inner.embed_tokens = StageInput()
    for module in list(model.modules()):
        shard = getattr(module, "shard", None)
        if shard is not None:
            shard(layout)
    for layer in list(inner.layers)[:layout.host_moe_layers]:
        for module in layer.modules():
            place = getattr(module, "place_on_host", None)
            if place is not None:
                place()


def weight_names(model: nn.Module, layout: ParallelLayout) -> Callable[[str], str | None]:
    """checkpoint name -> the name this rank loads it under, or None where another stage
    holds it."""
    if layout.num_stages == 1:
        return lambda name: name
    stage = layout.stage
    head_from_embedding = layout.last and getattr(model.lm_head, "loads_embedding", False)

    def rename(name: str) -> str | None:
        m = _LAYER.match(name)
        if m is not None:
            return name if stage.start <= int(m.group(1)) < stage.end else None
        if name.startswith("model.embed_tokens."):
            if layout.first:
                return name
            return "lm_head." + name.rsplit(".", 1)[1] if head_from_embedding else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if layout.last else None
        return name

    return rename


def attention_layers(model: nn.Module) -> list[Attention]:
    """The Attention modules this rank runs, in layer order (the runner binds a KV cache to
    each)."""
    return [m for m in model.modules() if isinstance(m, Attention)]
