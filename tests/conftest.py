from __future__ import annotations

import os
import tempfile

# Tests never read (or write) this user's tuned kernel configs (`skyline tune`): an empty
# cache of their own, set before skyline's settings (skyline/envs.py) are read.
os.environ["SKYLINE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="skyline-kernel-cache-")

# Without a GPU, Triton kernels run in Triton's interpreter (small shapes only), so every
# kernel's shape-sweep test also runs on CPU machines. Must be set before triton is imported.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

import pytest  # noqa: E402

TINY_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=319, bos_token_id=1, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Builds a tiny random Llama with HF transformers and saves it (safetensors) in a new
    directory, whose path it returns: `tiny_llama(std, name, **config)`. Its 2-D weights are
    drawn with standard deviation `std` (0.15, larger than the default init, makes greedy
    decoding wander; 0.02 makes it repeat itself); `config` overrides TINY_LLAMA."""
    transformers = pytest.importorskip("transformers")

    def build(std: float = 0.15, name: str = "llama", **config) -> str:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA | config))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, std)
        path = tmp_path_factory.mktemp(name)
        model.eval().save_pretrained(path, safe_serialization=True)
        return str(path)

    return build
