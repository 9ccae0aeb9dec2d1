"""`skyline quantize`'s size report: each part's bytes from the safetensors header, against
the source, and why an output with float32 embeddings is larger than a GGUF source."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from skyline.tools.quantize.sizes import checkpoint_parts, size_report


def test_parts_and_the_larger_than_source_explanation(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    save_file({
        "model.embed_tokens.weight": torch.zeros(1000, 64),  # 256 000 bytes
        "model.layers.0.self_attn.q_proj.qweight": torch.zeros(64, 32, dtype=torch.uint8),
        "model.layers.0.self_attn.q_proj.scales": torch.zeros(64, 1),
        "model.layers.0.input_layernorm.weight": torch.zeros(64),
        "model.norm.weight": torch.zeros(64),
    }, str(out / "model.safetensors"))
    parts = checkpoint_parts(str(out))
    assert parts["embeddings"] == {"bytes": 256_000, "dtypes": {"float32"}}
    assert parts["Linears"] == {"bytes": 64 * 32 + 64 * 4, "dtypes": {"uint8", "float32"}}
    assert parts["norms"]["bytes"] == 2 * 64 * 4 and "LM head" not in parts
    small = tmp_path / "model.gguf"
    small.write_bytes(b"\0" * 100_000)
    text = size_report(str(out), str(small), "int4")
    assert "source model.gguf: 0.1 MB" in text
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert "embeddings 0.3 MB (float32; tied, so also the LM head)" in lines
    assert "Linears 0.0 MB (int4, stored as float32, uint8)" in lines
    assert "larger than the source: only the Linears are quantized; the embeddings stay in " \
           "float32 (0.3 MB)" in text
    small.write_bytes(b"\0" * 1_000_000)
    assert "larger than the source" not in size_report(str(out), str(small), "int4")
