"""A pre-quantized layout skyline does not load is one sentence that names it, never a crash or
garbage."""

from __future__ import annotations

import pytest
import torch
from prequant_ckpt import gptq_checkpoint, tiny_llama, write

from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.model.loader import load_model

transformers = pytest.importorskip("transformers")

CT_INT = {"format": "pack-quantized", "targets": ["Linear"],
          "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                      "symmetric": True}}
REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv' packing"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "AWQ without zero points"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit GPTQ"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "GPTQ's 'marlin' format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*down": {}}},
     "per-module settings"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True},
     "quantized LM head"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "groups of 48 columns"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"a": CT_INT, "b": {**CT_INT, "weights": {**CT_INT["weights"],
                                                                  "num_bits": 8}}}},
     "more than one weight scheme"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"a": {**CT_INT, "format": "int-quantized"}}},
     "'int-quantized' format"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"a": {**CT_INT, "input_activations": {"num_bits": 8, "type": "int"}}}},
     "quantized activations"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"a": {"weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                          "block_structure": [128, 64]}}}},
     "blocks of (128, 64)"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {"a": CT_INT}},
     "sparsity"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "ModelOpt's 'W4A8_AWQ'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "with 'bitsandbytes'"),
    ({"quant_method": "hqq"}, "with 'hqq'"),
]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


def engine_config(path: str, quantization: str | None = None):
    return create_engine_config(EngineArgs(model=path, dtype="float32", device="cpu",
                                           quantization=quantization))[0]


@pytest.mark.parametrize(("quant", "named"), REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_layout_is_one_sentence(hf_model, tmp_path, quant, named):
    path = write(hf_model, tmp_path, {}, quant)
    with pytest.raises(ConfigError) as e:
        engine_config(path)
    msg = str(e.value)
    assert named in msg and "\n" not in msg and msg.count(". ") == 0, msg


def test_quantization_flag_must_agree(hf_model, tmp_path):
    path, _ = gptq_checkpoint(hf_model, tmp_path, bits=4, group=128)
    assert engine_config(path, "int4").model.quant.method == "int4"
    with pytest.raises(ConfigError, match="already quantized .*pass int4"):
        engine_config(path, "fp8")


def test_partly_quantized_merged_projection_is_refused(hf_model, tmp_path):
    path, _ = gptq_checkpoint(hf_model, tmp_path, bits=4, group=128)
    from safetensors.torch import load_file, save_file

    state = load_file(f"{path}/model.safetensors")
    name = "model.layers.0.self_attn.v_proj"
    for kind in ("qweight", "qzeros", "scales", "g_idx"):
        del state[f"{name}.{kind}"]
    state[f"{name}.weight"] = torch.zeros(64, 128)
    save_file(state, f"{path}/model.safetensors")
    with pytest.raises(ConfigError, match="quantizes some of .*v_proj but not all"):
        load_model(engine_config(path).model, "cpu")


def test_g_idx_that_contradicts_desc_act_is_refused(hf_model, tmp_path):
    path, _ = gptq_checkpoint(hf_model, tmp_path, bits=4, group=32, desc_act=True)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="g_idx reorders them"):
        load_model(engine_config(path).model, "cpu")
