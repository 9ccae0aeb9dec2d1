"""Shared fixture of the quantized-decode tests: a tiny random Llama saved as a HF checkpoint."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """2 layers, hidden 64 (4 heads of 16, 2 KV heads), MLP 96, vocabulary 128."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)
