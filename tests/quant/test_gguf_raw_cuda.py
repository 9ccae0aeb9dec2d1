"""GGUF Q6_K / Q5_K on CUDA at their own bits (quant/gguf_cuda.py): those runs keep their raw
blocks for the block kernels (ops/gemv_block.py), the other runs of a mixed layer become the
integer layout, and the layer gives the dense weights' product with a bias split over its
parts. The kernels run in Triton's interpreter here; the layer's CUDA path and a tiny K-quant
model on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from skyline.bench.gguf_blocks import random_blocks
from skyline.ops.dequant import dequantize_ref
from skyline.quant.gguf import GGUFLinearMethod, _cuda_ready, _int_apply

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


class _Layer(torch.nn.Module):
    """What GGUFLinearMethod needs of a Linear after loading: runs of raw blocks."""

    def __init__(self, runs: list[tuple[Q, int]], cols: int = 512, seed: int = 0) -> None:
        super().__init__()
        self.gguf_types = [int(q) for q, _ in runs]
        for i, (q, rows) in enumerate(runs):
            self.register_buffer(f"gguf_w{i}", random_blocks(q, rows, cols, seed + i).to(DEV))
        self.in_features = cols
        g = torch.Generator().manual_seed(seed)
        self.bias = torch.randn(sum(r for _, r in runs), generator=g).to(DEV)

    def dense(self) -> torch.Tensor:
        return torch.cat([dequantize_ref(getattr(self, f"gguf_w{i}"), q)
                          for i, q in enumerate(self.gguf_types)])


@pytest.mark.parametrize("runs,kinds", [
    ([(Q.Q6_K, 5)], ["raw"]),
    ([(Q.Q5_K, 3)], ["raw"]),
    ([(Q.Q4_K, 6), (Q.Q4_K, 2), (Q.Q6_K, 3)], ["int", "raw"]),  # Q4_K_M's q, k, v
    ([(Q.Q6_K, 2), (Q.Q8_0, 3), (Q.Q5_K, 4), (Q.Q4_0, 1)], ["raw", "int", "raw", "int"]),
], ids=["q6_k", "q5_k", "q4_k_m_qkv", "mixed"])
@pytest.mark.parametrize("rows", [1, 3])
def test_layer_keeps_k_quant_blocks_and_matches_the_dense_weights(runs, kinds, rows):
    layer = _Layer(runs)
    dense = layer.dense()
    raw_bytes = {i: getattr(layer, f"gguf_w{i}").data_ptr() for i, (q, _) in enumerate(runs)
                 if q in (Q.Q6_K, Q.Q5_K)}
    assert _cuda_ready(layer, torch.float32)
    assert [seg[2][0] for seg in layer.gguf_segments] == kinds
    for i in range(len(runs)):  # the K-quant runs keep their very blocks, the others go
        assert hasattr(layer, f"gguf_w{i}") == (i in raw_bytes)
        if i in raw_bytes:
            assert getattr(layer, f"gguf_w{i}").data_ptr() == raw_bytes[i]
    w = GGUFLinearMethod().dequantized_weight(layer)
    torch.testing.assert_close(w, dense, rtol=1e-6, atol=1e-7)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(DEV)
    want = F.linear(x, dense, layer.bias)
    tol = 1e-4 if DEV == "cpu" else 2e-3  # a GPU's matmul kernels may round through tf32
    torch.testing.assert_close(_int_apply(layer, x), want, rtol=tol,
                               atol=tol * want.abs().max().item())


def test_layer_without_k_quants_keeps_the_integer_layout():
    layer = _Layer([(Q.Q4_K, 4), (Q.Q3_K, 2)])
    assert _cuda_ready(layer, torch.float32)
    assert not hasattr(layer, "gguf_segments") and hasattr(layer, "gguf_qweight")


def test_k_quant_bits_a_weight():
    # what a K-quant layer holds on CUDA: the file's bytes, not 10-12 bits a weight
    for q, bits in ((Q.Q6_K, 6.5625), (Q.Q5_K, 5.5)):
        layer = _Layer([(q, 4)], cols=1024)
        _cuda_ready(layer, torch.float32)
        held = sum(b.numel() * b.element_size() for b in layer.buffers())
        assert held * 8 / (4 * 1024) == bits
        assert GGML_QUANT_SIZES[q][1] * 8 / 256 == bits


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_cuda_apply_of_a_mixed_layer(rows):
    layer = _Layer([(Q.Q4_K, 256), (Q.Q6_K, 128), (Q.Q5_K, 64)], cols=1024)
    layer.bias = layer.bias.to(torch.bfloat16)  # a model's bias is in its dtype
    dense = layer.dense()
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    y = GGUFLinearMethod().apply(layer, x)
    assert hasattr(layer, "gguf_w1") and hasattr(layer, "gguf_w2")
    want = F.linear(x.float(), dense, layer.bias.float())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_k_quant_model_on_cuda_matches_dense(tmp_path):
    """A tiny Llama whose Linears are Q4_K / Q5_K / Q6_K (random blocks): served packed on
    CUDA in bfloat16 (the block GEMV for 3 tokens, the scratch path for 40) it gives the
    logits of the weights dequantized at load."""
    from gguf import GGUFWriter

    from skyline.engine.args import EngineArgs
    from skyline.engine.create import create_engine_config
    from skyline.model.loader import load_model

    hidden, inter, vocab, layers = 256, 512, 96, 2
    path = str(tmp_path / "kquant.gguf")
    w = GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.normal(size=(vocab, hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    shapes = {"attn_q": (hidden, hidden, Q.Q4_K), "attn_k": (128, hidden, Q.Q4_K),
              "attn_v": (128, hidden, Q.Q6_K), "attn_output": (hidden, hidden, Q.Q5_K),
              "ffn_gate": (inter, hidden, Q.Q5_K), "ffn_up": (inter, hidden, Q.Q5_K),
              "ffn_down": (hidden, inter, Q.Q6_K)}
    for b in range(layers):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for i, (name, (rows, cols, q)) in enumerate(shapes.items()):
            data = random_blocks(q, rows, cols, seed=10 * b + i, scale=2e-4).numpy()
            w.add_tensor(f"blk.{b}.{name}.weight", data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def run(quantization: str | None, n: int) -> tuple[torch.Tensor, torch.nn.Module]:
        cfg, _ = create_engine_config(EngineArgs(model=path, dtype="bfloat16", device="cuda",
                                                 quantization=quantization))
        model = load_model(cfg.model, "cuda")
        ids = torch.arange(3, 3 + n, device="cuda") % vocab
        with torch.no_grad():
            return model.compute_logits(model(ids, torch.arange(n, device="cuda"))), model

    for n in (3, 40):
        dense, _ = run(None, n)
        packed, model = run("gguf", n)
        layer = model.model.layers[0].mlp.down_proj
        assert [seg[2][0] for seg in layer.gguf_segments] == ["raw"]
        err = ((packed - dense).norm() / dense.norm()).item()
        assert err < 3e-2, (n, err)
