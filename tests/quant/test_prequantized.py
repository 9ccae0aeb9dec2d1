"""Checkpoints pre-quantized by other tools load onto skyline's formats: GPTQ and AWQ packed
here from their documented layouts, compressed-tensors made by its own library, ModelOpt and
gpt-oss's MXFP4 written with their tensor names. Every quantized Linear dequantizes exactly to
the checkpoint's own dequantized weight; the logits match the float model those weights make
(with the checkpoint's activation quantization for FP8) and stay near skyline's own
quantization of the same model; greedy tokens match Hugging Face's."""

from __future__ import annotations

import pytest
import torch
from prequant_ckpt import (
    IDS,
    ct_checkpoint,
    dequantized_model,
    gptq_checkpoint,
    linear_weights,
    tiny_llama,
    write,
)

from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.model.loader import load_model, prepack_for_cpu
from skyline.ops.fp8_quant import FP8, quantize_rows_fp8_ref
from skyline.quant.fp4 import quantize_mxfp4, quantize_nvfp4
from skyline.quant.method import UnquantizedLinearMethod, linears

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama()


def model_cfg(path: str, dtype: str = "float32", quantization: str | None = None):
    cfg, _ = create_engine_config(EngineArgs(model=path, dtype=dtype, device="cpu",
                                             quantization=quantization, quant_group_size=32))
    return cfg.model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(IDS, torch.arange(len(IDS)))).float()


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[None]).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def check_weights(model, deq: dict[str, torch.Tensor]) -> None:
    """Every quantized Linear of the loaded skyline model dequantizes to the checkpoint's own
    dequantized weight, shard by shard."""
    seen = 0
    for name, layer in linears(model).items():
        method = layer.linear_method
        w = layer.weight if isinstance(method, UnquantizedLinearMethod) else \
            method.dequantized_weight(layer)
        for shard_id, (offset, size) in layer.shards.items():
            hf = model._hf_name(f"{name}.weight", shard_id).removesuffix(".weight")
            if hf in deq:
                torch.testing.assert_close(w[offset:offset + size].float(), deq[hf],
                                           rtol=2e-7, atol=0, msg=hf)
                seen += 1
    assert seen == len(deq)


GPTQ_CASES = [
    dict(bits=4, group=128),
    dict(bits=4, group=64, desc_act=True),
    dict(bits=4, group=32, desc_act=True, sym=False),
    dict(bits=4, group=128, sym=False, fmt="gptq_v2"),
    dict(bits=4, group=-1, desc_act=True),
    dict(bits=8, group=128, desc_act=True, sym=False),
    dict(awq=True, group=128),
    dict(awq=True, group=64),
    dict(awq=True, group=32),
]


@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in
                                                                    c.items()))
def test_gptq_awq_load_exactly(hf_model, tmp_path, case):
    path, deq = gptq_checkpoint(hf_model, tmp_path, **case)
    cfg = model_cfg(path)
    bits = case.get("bits", 4)
    group = case["group"] if case["group"] > 0 else 128
    assert (cfg.quant.method, cfg.quant.group_size) == (f"int{bits}", group)
    model = load_model(cfg, "cpu")
    check_weights(model, deq)
    qkv = model.model.layers[0].self_attn.qkv_proj
    # q/k/v read 128 columns: in one group (or per channel) the order changes nothing
    assert hasattr(qkv, "in_perm") == (case.get("desc_act", False) and 0 < case["group"] < 128)
    assert rel_err(logits(model), hf_logits(dequantized_model(hf_model, deq))) < 1e-5


def test_act_order_against_skyline_int4_and_bf16_kernel(hf_model, tmp_path):
    """An activation-ordered GPTQ model is as close to fp32 as skyline's own INT4 of the same
    weights, and its bf16 CPU serving layout (the int4 kernel's planes, x gathered first)
    computes what its float32 reference does."""
    path, deq = gptq_checkpoint(hf_model, tmp_path / "g", bits=4, group=32, desc_act=True,
                                sym=False)
    fp32 = hf_logits(hf_model)
    hf_model.save_pretrained(tmp_path / "f", safe_serialization=True)
    own = logits(load_model(model_cfg(str(tmp_path / "f"), quantization="int4"), "cpu"))
    theirs = logits(load_model(model_cfg(path), "cpu"))
    assert rel_err(theirs, fp32) < 2 * rel_err(own, fp32) + 0.01
    bf16 = load_model(model_cfg(path, "bfloat16"), "cpu")
    prepack_for_cpu(bf16, torch.bfloat16)
    assert not hasattr(bf16.model.layers[0].self_attn.qkv_proj, "qweight")  # planes only
    assert rel_err(logits(bf16), theirs) < 0.02


def test_act_order_orders_that_differ_run_unquantized(hf_model, tmp_path):
    path, deq = gptq_checkpoint(hf_model, tmp_path, bits=4, group=32, desc_act=True)
    # give k_proj of layer 0 its own order: q, k and v no longer share one
    from safetensors.torch import load_file, save_file

    state = load_file(f"{path}/model.safetensors")
    name = "model.layers.0.self_attn.k_proj"
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(9))
    w = deq[name][:, perm]  # k_proj's columns shuffled, each with its own group
    g_idx = state[f"{name}.g_idx"][perm]
    state[f"{name}.g_idx"] = g_idx.contiguous()
    from prequant_ckpt import pack_int32

    codes = torch.stack([(state[f"{name}.qweight"].t()[:, j // 8] >> (4 * (j % 8))) & 15
                         for j in range(128)], dim=1)[:, perm]
    state[f"{name}.qweight"] = pack_int32(codes.t(), 4, 0)
    save_file(state, f"{path}/model.safetensors")
    model = load_model(model_cfg(path), "cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.linear_method, UnquantizedLinearMethod)
    torch.testing.assert_close(qkv.weight[128:192], w, rtol=0, atol=0)  # dequantized exactly
    assert isinstance(model.model.layers[1].self_attn.qkv_proj.linear_method,
                      type(model.model.layers[0].mlp.down_proj.linear_method))


CT_CASES = [("W4A16", None), ("W4A16", 32), ("W4A16_ASYM", 64), ("W8A16", 128),
            ("NVFP4A16", None), ("MXFP4A16", None)]


@pytest.mark.parametrize(("preset", "group"), CT_CASES)
def test_compressed_tensors_weight_only(hf_model, tmp_path, preset, group):
    path, deq = ct_checkpoint(hf_model, tmp_path, preset, group)
    model = load_model(model_cfg(path), "cpu")
    check_weights(model, deq)
    assert rel_err(logits(model), hf_logits(dequantized_model(hf_model, deq))) < 1e-5


def fake_quant_hooks(model, mode: str, static: float) -> None:
    """Quantize every Linear's input as the checkpoint prescribes, in the HF reference."""
    def hook(_m, args):
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1]).float()
        if mode == "static":
            s = torch.tensor(static)
            xd = (x2 / s).clamp(-448, 448).to(FP8).float() * s
        else:
            block = 128 if mode == "block" else 0
            q, s = quantize_rows_fp8_ref(x2, block)
            xd = q.float() * (s.repeat_interleave(128, 1)[:, :x2.shape[1]] if block else s)
        return (xd.reshape(x.shape).to(x.dtype),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and "lm_head" not in name:
            m.register_forward_pre_hook(hook)


@pytest.mark.parametrize(("preset", "mode"), [("FP8", "static"), ("FP8_DYNAMIC", "token"),
                                              ("FP8_BLOCK", "block")])
def test_compressed_tensors_fp8(hf_model, tmp_path, preset, mode):
    path, deq = ct_checkpoint(hf_model, tmp_path / "ct", preset, input_scale=0.02)
    cfg = model_cfg(path)
    assert cfg.quant.layout.static_input == (mode == "static")
    assert (cfg.quant.layout.weight_block is not None) == (mode == "block")
    model = load_model(cfg, "cpu")
    check_weights(model, deq)
    ref = dequantized_model(hf_model, deq)
    fake_quant_hooks(ref, mode, 0.02)
    got = logits(model)
    assert rel_err(got, hf_logits(ref)) < 1e-4
    hf_model.save_pretrained(tmp_path / "f", safe_serialization=True)
    own = logits(load_model(model_cfg(str(tmp_path / "f"), quantization="fp8"), "cpu"))
    assert rel_err(got, own) < 0.05  # skyline's own fp8 of the same model
    prepack_for_cpu(model, torch.float32)  # the CPU serving layout: dequantized once
    assert rel_err(logits(model), got) < 1e-5


def modelopt_checkpoint(hf_model, out, algo: str):
    tensors, deq = {}, {}
    for name, w in linear_weights(hf_model).items():
        if "mlp" not in name:  # attention left unquantized, as exclude_modules may say
            continue
        if algo == "FP8":
            scale = w.abs().amax() / 448
            q = (w / scale).to(FP8)
            tensors.update({f"{name}.weight": q, f"{name}.weight_scale": scale.reshape(()),
                            f"{name}.input_scale": torch.tensor(0.02)})
            deq[name] = q.float() * scale
        else:
            packed, scales, tensor_scale = quantize_nvfp4(w)
            tensors.update({f"{name}.weight": packed, f"{name}.weight_scale": scales,
                            f"{name}.weight_scale_2": tensor_scale.reshape(()),
                            f"{name}.input_scale": torch.tensor(0.5)})
            from skyline.quant.fp4 import dequantize_nvfp4

            deq[name] = dequantize_nvfp4(packed, scales, tensor_scale)
        tensors[f"{name.rsplit('.', 2)[0]}.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    for name, w in linear_weights(hf_model).items():
        if name not in deq:
            tensors[f"{name}.weight"] = w
    quant = {"producer": {"name": "modelopt"},
             "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8",
                              "exclude_modules": ["lm_head", "*self_attn*"]}}
    return write(hf_model, out, tensors, quant, "hf_quant_config.json"), deq


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
def test_modelopt(hf_model, tmp_path, algo):
    path, deq = modelopt_checkpoint(hf_model, tmp_path, algo)
    cfg = model_cfg(path)
    assert cfg.quant.method == algo.lower()
    model = load_model(cfg, "cpu")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.linear_method,
                      UnquantizedLinearMethod)
    check_weights(model, deq)
    ref = dequantized_model(hf_model, deq)
    if algo == "FP8":
        fake_quant_hooks(ref.model.layers[0].mlp, "static", 0.02)
        fake_quant_hooks(ref.model.layers[1].mlp, "static", 0.02)
    assert rel_err(logits(model), hf_logits(ref)) < 1e-4
    if algo == "NVFP4":  # skyline's own NVFP4 is the same format: the same model exactly
        hf_model.save_pretrained(tmp_path / "f", safe_serialization=True)
        own = load_model(model_cfg(str(tmp_path / "f"), quantization="nvfp4"), "cpu")
        for i in range(2):
            a, b = own.model.layers[i].mlp.down_proj, model.model.layers[i].mlp.down_proj
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.tensor_scale,
                                                                     b.tensor_scale)


def test_gpt_oss_style_mxfp4_dense(hf_model, tmp_path):
    """gpt-oss's naming (`*_blocks` [rows, K / 32, 16], `*_scales`) on dense Linears: the MLPs
    load onto skyline's MXFP4 Linear, bit for bit what skyline's own MXFP4 makes; attention,
    stored in full precision, stays unquantized."""
    tensors, deq = {}, {}
    for name, w in linear_weights(hf_model).items():
        if "mlp" in name:
            packed, scales = quantize_mxfp4(w)
            tensors[f"{name}.weight_blocks"] = packed.reshape(w.shape[0], -1, 16)
            tensors[f"{name}.weight_scales"] = scales
            from skyline.quant.fp4 import dequantize_mxfp4

            deq[name] = dequantize_mxfp4(packed, scales)
        else:
            tensors[f"{name}.weight"] = w
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    path = write(hf_model, tmp_path, tensors, quant)
    model = load_model(model_cfg(path), "cpu")
    check_weights(model, deq)
    assert isinstance(model.model.layers[0].self_attn.o_proj.linear_method,
                      UnquantizedLinearMethod)
    assert rel_err(logits(model), hf_logits(dequantized_model(hf_model, deq))) < 1e-5


def test_greedy_tokens_match_transformers(hf_model, tmp_path):
    """An activation-ordered GPTQ model served by the engine generates the greedy tokens of
    Hugging Face's model with the same (dequantized) weights."""
    from skyline.engine.frontend.llm import LLM
    from skyline.types import SamplingParams

    path, deq = gptq_checkpoint(hf_model, tmp_path, bits=4, group=32, desc_act=True)
    ref = dequantized_model(hf_model, deq)
    prompts = [[5, 17, 42, 7], [9, 3]]
    want = []
    for p in prompts:
        out = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                           pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    llm = LLM(model=path, num_blocks=32, dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
