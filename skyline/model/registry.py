"""HF architecture name -> model class. The one registry; add a line per architecture."""

from __future__ import annotations

from torch import nn

from skyline.config import ConfigError
from skyline.model.gpt_oss import GptOssForCausalLM
from skyline.model.llama import LlamaForCausalLM
from skyline.model.mixtral import MixtralForCausalLM
from skyline.model.qwen3 import Qwen3ForCausalLM
from skyline.model.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,  # q/k/v bias comes from ModelArch.attention_bias
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}


def get_model_class(arch: str) -> type[nn.Module]:
    """The class serving HF architecture `arch` (e.g. "LlamaForCausalLM")."""
    cls = MODEL_REGISTRY.get(arch)
    if cls is None:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ConfigError(f"architecture {arch} is not supported; skyline supports: {supported}")
    return cls
