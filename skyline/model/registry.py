"""HF architecture name -> model class. The one registry; add a line per architecture."""

from __future__ import annotations

from torch import nn

from skyline.config import ConfigError
from skyline.model.llama import LlamaForCausalLM
from skyline.model.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias comes from ModelArch.attention_bias
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(arch: str) -> type[nn.Module]:
    """The class serving HF architecture `arch` (e.g. "LlamaForCausalLM")."""
    cls = MODEL_REGISTRY.get(arch)
    if cls is None:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ConfigError(f"architecture {arch} is not supported; skyline supports: {supported}")
    return cls
