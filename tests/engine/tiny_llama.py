"""A tiny random Llama saved as a Hugging Face checkpoint, for engine tests against
transformers (the reference) or another device."""

from __future__ import annotations

from typing import Any

import torch


def save_tiny_llama(path: Any, std: float = 0.15, **config: Any) -> Any:
    """Save a 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 320 unless `config`
    says otherwise) to `path`; returns the transformers model. Weights drawn with `std`,
    larger than the default init, so that greedy decoding is not one repeated token."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        **config})
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    model.save_pretrained(path, safe_serialization=True)
    return model
