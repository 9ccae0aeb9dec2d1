"""Quantized models end to end: a tiny HF Llama quantized with each format stays close to its
fp32 logits and runs through the engine; quantize -> save -> load equals quantizing in memory;
GGUF blocks kept packed give the dequantized-at-load logits; bad values give one clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyline.config import ConfigError, QuantConfig
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config
from skyline.model.loader import load_model
from skyline.quant.calibrate import collect_act_sq
from skyline.quant.checkpoint import quantize_loaded
from skyline.tools.quantize.checkpoint import quantize_checkpoint

transformers = pytest.importorskip("transformers")

FORMATS = ["fp8", "int8", "int4", "mxfp4", "nvfp4"]
# Relative logit error bounds vs fp32 on the random-weight model below, about twice what each
# format measures there (int8 0.3%, fp8 2.5%, int4 5.7%, nvfp4 6.3%, mxfp4 7.8%).
BOUNDS = {"fp8": 0.05, "int8": 0.008, "int4": 0.1, "mxfp4": 0.15, "nvfp4": 0.12}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)
            else:  # small enough that two layers do not amplify errors chaotically
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def model_cfg(path: str, quantization: str | None = None, group_size: int = 32):
    cfg, _ = create_engine_config(EngineArgs(model=path, dtype="float32", device="cpu",
                                             quantization=quantization,
                                             quant_group_size=group_size))
    return cfg.model


IDS = torch.tensor([(17 * i + 3) % 256 for i in range(40)])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(IDS, torch.arange(len(IDS))))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ref_logits(hf_dir):
    return logits(load_model(model_cfg(hf_dir), "cpu"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_logits_close_to_fp32(hf_dir, ref_logits, fmt):
    cfg = model_cfg(hf_dir, fmt)
    assert cfg.quant == QuantConfig(method=fmt, group_size=32)
    out = logits(load_model(cfg, "cpu"))
    assert rel_err(out, ref_logits) < BOUNDS[fmt]
    assert rel_err(out, ref_logits) > 0  # really quantized


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_model_runs_in_engine(hf_dir, fmt):
    from skyline.engine.frontend.llm import LLM
    from skyline.types import SamplingParams

    llm = LLM(model=hf_dir, quantization=fmt, quant_group_size=32, num_blocks=32,
              dtype="float32", device="cpu")
    outs = llm.generate([[1, 2, 3, 4], [5, 6]], SamplingParams(max_tokens=5, temperature=0.0,
                                                                 ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_load_round_trip_equals_in_memory(hf_dir, tmp_path, fmt):
    calib = [(5 * i + 1) % 256 for i in range(96)]
    quantize_checkpoint(model_cfg(hf_dir, "none"), fmt, str(tmp_path), group_size=32,
                        calib_ids=calib)
    cfg = model_cfg(str(tmp_path))
    assert cfg.quant == QuantConfig(method=fmt, group_size=32, prequantized=True)
    loaded = load_model(cfg, "cpu")

    mem = load_model(model_cfg(hf_dir, "none"), "cpu")
    act_sq = collect_act_sq(mem, calib)
    quantize_loaded(mem, dataclasses.replace(cfg.quant, prequantized=False), act_sq)
    want = dict(mem.named_parameters())
    got = dict(loaded.named_parameters())
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert t.dtype == got[name].dtype and torch.equal(t.float(), got[name].float()), name
    assert torch.equal(logits(loaded), logits(mem))


def test_bad_quantization_value_is_one_clear_error(hf_dir, capsys):
    with pytest.raises(ConfigError, match="--quantization must be one of none, fp8"):
        create_engine_config(EngineArgs(model=hf_dir, quantization="int3"))
    with pytest.raises(ConfigError, match="needs a .gguf model"):
        create_engine_config(EngineArgs(model=hf_dir, quantization="gguf"))
    from skyline.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", hf_dir, "--quantization", "int3"])
    assert str(e.value).startswith("skyline: error: --quantization must be one of")
    assert "\n" not in str(e.value)


def test_fp8_lm_head(hf_dir, ref_logits):
    """--quantize-lm-head: the head computes from an e4m3 copy (one scale per vocabulary row),
    close to the fp8 model with a dense head; with other weight formats too."""
    cfg, _ = create_engine_config(EngineArgs(model=hf_dir, dtype="float32", device="cpu",
                                             quantization="fp8", quantize_lm_head=True))
    model = load_model(cfg.model, "cpu")
    head = model.lm_head
    assert head.fp8_weight.dtype == torch.float8_e4m3fn
    assert head.fp8_scale.shape == (head.vocab_size,)
    dense_head = load_model(model_cfg(hf_dir, "fp8"), "cpu")
    got, want = logits(model), logits(dense_head)
    assert 0 < rel_err(got, want) < 0.05
    assert rel_err(got, ref_logits) < 2 * BOUNDS["fp8"]
    # As a CPU engine serves it (prepack_for_cpu): the e4m3 values packed for oneDNN, the same
    # logits as the per-call emulation but for float32 summation order
    from skyline.model.loader import prepack_for_cpu

    prepack_for_cpu(model, torch.float32)
    if head.packed_weight is not None:
        assert rel_err(logits(model), got) < 1e-5
    for method in ("int4", "none"):  # the head's format is its own
        cfg, _ = create_engine_config(EngineArgs(model=hf_dir, dtype="float32", device="cpu",
                                                 quantization=method, quantize_lm_head=True))
        model = load_model(cfg.model, "cpu")
        assert model.lm_head.fp8_weight is not None
        dense_head = load_model(model_cfg(hf_dir, method), "cpu")
        assert 0 < rel_err(logits(model), logits(dense_head)) < 2 * BOUNDS["fp8"]


@pytest.mark.parametrize("method,planes", [("int4", 1), ("int8", 2)])
def test_cpu_engine_keeps_only_the_int4_kernel_planes(hf_dir, method, planes):
    """A CPU engine in bfloat16 (prepack_for_cpu) serves INT4 / INT8 from the int4 kernel's
    planes alone: the packed tensors are dropped, the logits are those of the layer run
    before prepacking (the same planes), and the weights read back within bf16 rounding."""
    from skyline.model.loader import prepack_for_cpu
    from skyline.ops import cpu_int4

    if not cpu_int4.has_kernel():
        pytest.skip("torch lacks the CPU int4 kernel")
    cfg, _ = create_engine_config(EngineArgs(model=hf_dir, dtype="bfloat16", device="cpu",
                                             quantization=method, quant_group_size=32))
    model = load_model(cfg.model, "cpu")
    layer = model.model.layers[0].mlp.down_proj
    w = layer.linear_method.dequantized_weight(layer)
    before = logits(model)  # the first bf16 calls build the planes beside the packed tensors
    assert prepack_for_cpu(model, torch.bfloat16) > 0
    assert not hasattr(layer, "qweight") and len(layer.int_planes) == planes
    assert torch.equal(logits(model), before)
    w_back = layer.linear_method.dequantized_weight(layer)
    assert (w_back - w).abs().max() / w.abs().max() < 1e-2
    planes_bytes = sum(t.numel() * t.element_size() for p in layer.int_planes for t in p)
    assert planes_bytes * 8 / w.numel() == (5 if planes == 1 else 10)  # codes + bf16 s, z


@pytest.mark.parametrize("method,dtype", [("mxfp4", "bfloat16"), ("nvfp4", "bfloat16"),
                                          ("fp8", "bfloat16"), ("fp8", "float32")])
def test_cpu_engine_does_not_dequantize_per_call(hf_dir, method, dtype):
    """On a CPU engine MXFP4 in bfloat16 keeps only the int4 kernel's two exact planes; NVFP4
    (16-element blocks, which no CPU kernel takes) and FP8 (no CPU fp8 units) keep their
    weight dequantized once in the engine's dtype; all give the logits of the per-call
    dequantization within that dtype's rounding."""
    from skyline.model.loader import prepack_for_cpu
    from skyline.ops import cpu_int4

    if method == "mxfp4" and not cpu_int4.has_kernel():
        pytest.skip("torch lacks the CPU int4 kernel")
    cfg, _ = create_engine_config(EngineArgs(model=hf_dir, dtype=dtype, device="cpu",
                                             quantization=method))
    model = load_model(cfg.model, "cpu")
    layer = model.model.layers[0].mlp.down_proj
    w = layer.linear_method.dequantized_weight(layer)
    x = torch.randn(3, layer.in_features).to(getattr(torch, dtype))
    want = layer(x)  # the per-call path
    before = logits(model)
    assert prepack_for_cpu(model, getattr(torch, dtype)) > 0
    assert not hasattr(layer, "qweight") and not hasattr(layer, "weight_scale")
    rounded = w if method == "mxfp4" else w.to(getattr(torch, dtype)).float()
    assert torch.equal(layer.linear_method.dequantized_weight(layer), rounded)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    assert rel_err(layer(x).float(), want.float()) < tol
    assert rel_err(logits(model), before) < tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_lm_head_on_cuda(hf_dir):
    # bf16 on the GPU: the fp8 GEMV for a few rows, _scaled_mm (or the emulation) for more;
    # both close to the same model with its dense head
    def load(head: bool):
        cfg, _ = create_engine_config(EngineArgs(model=hf_dir, dtype="bfloat16", device="cuda",
                                                 quantization="fp8", quantize_lm_head=head))
        return load_model(cfg.model, "cuda")

    fp8_head, dense_head = load(True), load(False)
    for n in (3, 40):
        ids, pos = IDS[:n].cuda(), torch.arange(n, device="cuda")
        with torch.no_grad():
            got = fp8_head.compute_logits(fp8_head(ids, pos))
            want = dense_head.compute_logits(dense_head(ids, pos))
        assert got.dtype == torch.float32 and rel_err(got, want) < 0.05


def test_gguf_packed_equals_dequantized_at_load():
    from skyline.model.default import default_model_path

    try:
        default_model_path()
    except ConfigError:
        pytest.skip("the default GGUF model is not installed")
    dense = load_model(model_cfg(None), "cpu")
    packed_cfg = model_cfg(None, "gguf")
    packed = load_model(packed_cfg, "cpu")
    assert packed.model.layers[0].self_attn.qkv_proj.gguf_w0.dtype == torch.uint8
    torch.testing.assert_close(logits(packed), logits(dense), rtol=1e-5, atol=1e-4)
    size = sum(b.numel() for m in packed.modules() for n, b in m.named_buffers(recurse=False)
               if n.startswith("gguf_w"))
    dense_size = sum(4 * m.weight.numel() for m in dense.modules() if hasattr(m, "shards"))
    assert size < dense_size / 6  # Q4_1 is 5 bits a weight vs fp32's 32


def test_gguf_packed_bf16_runs_the_int4_kernel():
    """bfloat16 on the CPU: the default model's Q4_1 layers run torch's int4 kernel, about as
    close to the float32 model as the dense bfloat16 model is."""
    from skyline.model.default import default_model_path

    try:
        default_model_path()
    except ConfigError:
        pytest.skip("the default GGUF model is not installed")

    def cfg(dtype, quantization=None):
        c, _ = create_engine_config(EngineArgs(dtype=dtype, device="cpu",
                                               quantization=quantization))
        return c.model

    ref = logits(load_model(cfg("float32"), "cpu"))
    dense = logits(load_model(cfg("bfloat16"), "cpu")).float()
    packed_model = load_model(cfg("bfloat16", "gguf"), "cpu")
    packed = logits(packed_model).float()
    assert packed_model.model.layers[0].mlp.gate_up_proj.gguf_int4 is not None
    assert rel_err(packed, ref) < 1.5 * rel_err(dense, ref)  # 0.0105 vs 0.0089 measured


def test_quantize_cli_writes_a_loadable_checkpoint(hf_dir, tmp_path, ref_logits, capsys):
    from skyline.cli import main

    out = tmp_path / "int8"
    main(["quantize", hf_dir, "--format", "int8", "--out", str(out), "--group-size", "32"])
    printed = capsys.readouterr().out
    assert "  Linears " in printed and "(int8, stored as" in printed and "  norms " in printed
    cfg = model_cfg(str(out))
    assert (cfg.quant.method, cfg.quant.prequantized) == ("int8", True)
    assert rel_err(logits(load_model(cfg, "cpu")), ref_logits) < BOUNDS["int8"]
    with pytest.raises(SystemExit, match="already quantized as int8"):
        main(["quantize", str(out), "--format", "int4", "--out", str(tmp_path / "again")])


def test_cpu_int_formats_load_in_bfloat16_unless_told(hf_dir, tmp_path, caplog):
    # the dtype their kernels want, whether asked for or the checkpoint's own format
    cfg, _ = create_engine_config(EngineArgs(model=hf_dir, device="cpu", quantization="int4"))
    assert cfg.model.dtype == "bfloat16"
    quantize_checkpoint(model_cfg(hf_dir, "none"), "int8", str(tmp_path), group_size=32)
    cfg, _ = create_engine_config(EngineArgs(model=str(tmp_path), device="cpu"))
    assert (cfg.model.quant.method, cfg.model.dtype) == ("int8", "bfloat16")
    cfg, _ = create_engine_config(EngineArgs(model=hf_dir, device="cpu", quantization="fp8"))
    assert cfg.model.dtype == "float32"
    with caplog.at_level("WARNING", logger="skyline.engine.create"):
        create_engine_config(EngineArgs(model=hf_dir, device="cpu", dtype="float32",
                                        quantization="int4"))
    assert "--dtype auto or bfloat16" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="skyline.engine.create"):
        create_engine_config(EngineArgs(model=hf_dir, device="cpu", dtype="bfloat16",
                                        quantization="mxfp4"))
        create_engine_config(EngineArgs(model=hf_dir, device="cpu", quantization="fp8"))
    assert "--dtype auto or bfloat16" not in caplog.text
