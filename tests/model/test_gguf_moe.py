"""Mixture-of-experts GGUF files (qwen3moe; Mixtral as llama with experts), written from tiny
random transformers models as llama.cpp's converter writes them (experts stacked per layer,
Mixtral's Q/K rows permuted): skyline's logits equal transformers' (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from test_gguf import permute, write_header

from skyline.config import ConfigError, ModelArch, ModelConfig, QuantConfig
from skyline.model.gguf import read_gguf_hf_config
from skyline.model.loader import load_model, read_model_arch

transformers = pytest.importorskip("transformers")

KW = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
          tie_word_embeddings=False)
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def tiny(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "qwen3moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **KW, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, rope_theta=10000.0))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **KW, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
            rope_theta=10000.0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def write(path: str, model: torch.nn.Module, arch: str) -> None:
    c = model.config
    w = GGUFWriter(path, "llama" if arch == "mixtral" else arch)
    write_header(w, c, head_dim=True)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    glob = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, t in model.state_dict().items():  # transformers' own (stacked experts) names
        a = t.numpy().astype(np.float32)
        if name in glob:
            w.add_tensor(glob[name], a)
            continue
        _, _, i, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module == "mlp.experts" and kind == "gate_up_proj":  # [E, 2I, H]
            half = a.shape[1] // 2
            w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :half]))
            w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(a[:, half:]))
            continue
        if module == "mlp.experts":  # down_proj [E, H, I]
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", a)
            continue
        if arch == "mixtral" and module.endswith(("q_proj", "k_proj")):
            heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
            a = permute(a, heads)  # llama.cpp's converter permutes llama's Q/K rows
        w.add_tensor(f"blk.{i}.{LAYER[module]}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("packed", [False, True])
def test_moe_gguf_matches_hf(tmp_path, arch, packed):
    """`packed`: --quantization gguf, the Linears' blocks kept as stored, the experts
    dequantized while loading."""
    model = tiny(arch)
    path = str(tmp_path / f"{arch}.gguf")
    write(path, model, arch)
    cfg = ModelArch.from_hf_config(read_gguf_hf_config(path))
    assert cfg.architecture == type(model).__name__
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    arch_, fmt = read_model_arch(path)
    quant = QuantConfig(method="gguf" if packed else "none")
    sky = load_model(ModelConfig(path, fmt, arch_, "float32", 256, quant=quant), "cpu")
    ids = [3, 17, 5, 90, 44, 1, 60, 8, 12]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
        got = sky.compute_logits(sky(torch.tensor(ids), torch.arange(len(ids))))
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_experts_one_tensor_each_are_refused(tmp_path):
    path = str(tmp_path / "old.gguf")
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_expert_count(2)
    w.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="one tensor each.*convert the model again"):
        read_gguf_hf_config(path)
