"""Each tensor-parallel rank and pipeline stage loads exactly its part of the checkpoint, in
every weight format: the ranks' slices put back together are the one-process weights. (No
processes: loading needs no collective.)"""

from __future__ import annotations

import pytest
import torch

from skyline.config import ConfigError, ModelConfig, QuantConfig
from skyline.model.default import default_model_path
from skyline.model.layers.linear import Linear
from skyline.model.loader import load_model, read_model_arch
from skyline.parallel.groups import Group, ParallelLayout
from skyline.parallel.placement import Stage

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("qwen2")
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


def layout(num_layers: int, tp: int, index: int, stage: tuple[int, int] | None = None,
           num_stages: int = 1, stage_index: int = 0) -> ParallelLayout:
    start, end = stage or (0, num_layers)
    rank = stage_index * tp + index
    return ParallelLayout(rank, tp * num_stages, Stage("cpu", start, end), stage_index,
                          num_stages, Group(range(stage_index * tp, (stage_index + 1) * tp), rank),
                          Group((rank,), rank), Group((rank,), rank), Group((rank,), rank))


def model_cfg(path: str, quant: QuantConfig | None = None) -> ModelConfig:
    arch, fmt = read_model_arch(path)
    return ModelConfig(path, fmt, arch, "float32", 64, quant=quant or QuantConfig())


def weights(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            get = getattr(m.linear_method, "dequantized_weight", None)
            out[name] = get(m) if get is not None else m.full_weight()
            if m.bias is not None:
                out[name + ".bias"] = m.bias.data
    return out


def check_tp(cfg: ModelConfig, tp: int = 2, row_tol: float = 0.0) -> None:
    """`row_tol`: a format with a scale per output row quantizes a row-parallel slice with the
    slice's own scale, as close to the whole row's as the format's rounding."""
    full = weights(load_model(cfg, "cpu"))
    parts = [load_model(cfg, "cpu", layout(cfg.arch.num_layers, tp, i)) for i in range(tp)]
    shards = [weights(p) for p in parts]
    for name, w in full.items():
        if name.endswith(".bias") and "o_proj" in name:
            continue  # row-parallel bias: on the first rank only
        tol = 0.0
        if any(k in name for k in ("o_proj", "down_proj")):
            got = torch.cat([s[name] for s in shards], dim=1)
            tol = row_tol
        elif "qkv_proj" in name:  # each rank's q heads, then its k, then its v
            split = [_qkv(s[name], p, name) for s, p in zip(shards, parts, strict=True)]
            got = torch.cat([torch.cat([qkv[i] for qkv in split]) for i in range(3)])
            w = torch.cat(_qkv(w, None, name, cfg.arch))
        else:
            got = torch.cat([s[name] for s in shards], dim=0)
            if "gate_up" in name:  # gate then up on each rank
                half = [torch.chunk(s[name], 2) for s in shards]
                got = torch.cat([h[0] for h in half] + [h[1] for h in half])
        torch.testing.assert_close(got, w, rtol=tol, atol=tol * w.abs().max(), msg=name)
    # vocabulary-parallel embedding: the slices put together, padding cut
    emb = torch.cat([p.model.embed_tokens.weight for p in parts])[: cfg.arch.vocab_size]
    torch.testing.assert_close(emb, load_model(cfg, "cpu").model.embed_tokens.weight)


def _qkv(w: torch.Tensor, part, name: str, arch=None) -> list[torch.Tensor]:
    """[q, k, v] rows of a q/k/v weight (of rank `part`'s layer, or of the whole model)."""
    if part is None:
        q, k, v = w.split([arch.num_heads * arch.head_dim] + [arch.num_kv_heads
                                                               * arch.head_dim] * 2)
        return [q, k, v]
    layer = dict(part.named_modules())[name.removesuffix(".bias")]
    return list(w.split(layer.output_sizes))


def test_tensor_parallel_slices_every_format(hf_dir):
    check_tp(model_cfg(hf_dir))
    check_tp(model_cfg(hf_dir, QuantConfig("int4", group_size=32)))
    check_tp(model_cfg(hf_dir, QuantConfig("fp8")), row_tol=0.07)
    check_tp(model_cfg(hf_dir, QuantConfig("mxfp4")))


def test_quantized_row_split_must_cut_whole_groups(hf_dir):
    # o_proj has 64 inputs: 32 a rank, fewer than a group of 64
    with pytest.raises(ConfigError, match="groups of 64 cannot be split"):
        load_model(model_cfg(hf_dir, QuantConfig("int4", group_size=64)), "cpu",
                   layout(2, 2, 1))


def test_packed_gguf_slices_whole_blocks():
    path = default_model_path()
    arch, fmt = read_model_arch(path)
    cfg = ModelConfig(path, fmt, arch, "float32", 64, quant=QuantConfig("gguf"))
    full = load_model(cfg, "cpu")
    # 9 heads in 3 groups: rank 0 has 2 groups (384 inputs of o_proj), rank 1 one (192)
    parts = [load_model(cfg, "cpu", layout(arch.num_layers, 2, i)) for i in range(2)]
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.3.mlp.down_proj",
                 "model.layers.5.mlp.gate_up_proj"):
        dim = 0 if "gate_up" in name else 1
        mods = [dict(p.named_modules())[name] for p in parts]
        got = [m.linear_method.dequantized_weight(m) for m in mods]
        want = dict(full.named_modules())[name]
        want = want.linear_method.dequantized_weight(want)
        if dim == 0:
            got = [torch.cat([g.chunk(2)[i] for g in got]) for i in range(2)]
        torch.testing.assert_close(torch.cat(got, dim=dim), want, rtol=0, atol=0)
    o_proj = [p.model.layers[0].self_attn.o_proj.in_features for p in parts]
    assert o_proj == [384, 192]


def test_pipeline_stage_holds_its_layers_and_the_tied_head(hf_dir):
    cfg = model_cfg(hf_dir)
    full = load_model(cfg, "cpu")
    first = load_model(cfg, "cpu", layout(2, 1, 0, (0, 1), 2, 0))
    last = load_model(cfg, "cpu", layout(2, 1, 0, (1, 2), 2, 1))
    names = {n for n, _ in first.named_parameters()}
    assert "model.embed_tokens.weight" in names and "model.layers.0.mlp.down_proj.weight" in names
    assert not any(n.startswith(("model.layers.1.", "lm_head", "model.norm")) for n in names)
    held = dict(last.named_parameters())
    assert not any(n.startswith(("model.layers.0.", "model.embed_tokens")) for n in held)
    # the last stage's head is the (tied) embedding, loaded there from the checkpoint
    torch.testing.assert_close(held["lm_head.weight"], full.model.embed_tokens.weight)
    torch.testing.assert_close(held["model.layers.1.mlp.down_proj.weight"],
                               full.model.layers[1].mlp.down_proj.weight)
