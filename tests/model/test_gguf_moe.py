"""Mixture-of-experts GGUF files (qwen3moe; Mixtral as llama with experts), written from tiny
random transformers models as llama.cpp's converter writes them (experts stacked per layer,
Mixtral's Q/K rows permuted): skyline's logits equal transformers' (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from test_cpu_decode import _decode_inputs
from test_gguf import permute, write_header

from skyline import LLM, SamplingParams
from skyline.config import ConfigError, ModelArch, ModelConfig, QuantConfig
from skyline.model.forward_ctx import forward_context
from skyline.model.gguf import read_gguf_hf_config
from skyline.model.layers import cpu_decode
from skyline.model.layers.moe import FusedExperts
from skyline.model.loader import load_model, prepack_for_cpu, read_model_arch
from skyline.model.weights import held_bytes
from skyline.ops import cpu_ext, cpu_intdot, cpu_moe
from skyline.ops.moe import moe_activation_ref, moe_by_expert

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


def write(path: str, model: torch.nn.Module, arch: str, quant: bool = False,
          quant_attn: bool = False) -> None:
    """`quant`: the experts' gate and up in Q4_1, down in Q8_0 (llama.cpp's own rounding);
    `quant_attn`: the attention projections in Q8_0."""
    c = model.config

    def experts(name: str, a: np.ndarray) -> None:
        qtype = Q.Q8_0 if "down" in name else Q.Q4_1
        if quant:
            w.add_tensor(name, quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))

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
            experts(f"blk.{i}.ffn_gate_exps.weight", a[:, :half])
            experts(f"blk.{i}.ffn_up_exps.weight", a[:, half:])
            continue
        if module == "mlp.experts":  # down_proj [E, H, I]
            experts(f"blk.{i}.ffn_down_exps.weight", a)
            continue
        if arch == "mixtral" and module.endswith(("q_proj", "k_proj")):
            heads = c.num_attention_heads if "q_proj" in module else c.num_key_value_heads
            a = permute(a, heads)  # llama.cpp's converter permutes llama's Q/K rows
        if quant_attn and module.endswith("_proj"):
            w.add_tensor(f"blk.{i}.{LAYER[module]}.{kind}", quantize(a, Q.Q8_0),
                         raw_dtype=Q.Q8_0)
            continue
        w.add_tensor(f"blk.{i}.{LAYER[module]}.{kind}", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral"])
@pytest.mark.parametrize("packed", [False, True])
def test_moe_gguf_matches_hf(tmp_path, arch, packed):
    """`packed`: --quantization gguf, the Linears' and experts' blocks kept as stored
    (float32 ones here: dequantized at each call)."""
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


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("moe") / "qwen3moe-q.gguf")
    write(path, tiny("qwen3moe"), "qwen3moe", quant=True)
    return path


def _load(path: str, method: str) -> torch.nn.Module:
    arch, fmt = read_model_arch(path)
    quant = QuantConfig(method=method)
    return load_model(ModelConfig(path, fmt, arch, "float32", 256, quant=quant), "cpu")


def _experts(model: torch.nn.Module) -> list[FusedExperts]:
    return [m for m in model.modules() if isinstance(m, FusedExperts)]


IDS = [3, 17, 5, 90, 44, 1, 60, 8, 12, 33, 71]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(IDS), torch.arange(len(IDS))))


def test_quantized_experts_keep_their_blocks(quantized):
    """--quantization gguf holds the experts' blocks as the file stores them, and computes
    what the experts dequantized while loading compute."""
    packed, dense = _load(quantized, "gguf"), _load(quantized, "none")
    for m in _experts(packed):
        assert not hasattr(m, "w13") and [t for t, _ in m.gguf_blocks["w13"]] == [Q.Q4_1] * 2
        assert [t for t, _ in m.gguf_blocks["w2"]] == [Q.Q8_0]
    want = _logits(dense)
    assert ((_logits(packed) - want).norm() / want.norm()).item() < 1e-5


def test_cpu_engine_runs_experts_on_the_integer_dot_kernel(quantized):
    """A CPU engine's layout: each expert's codes for the integer dot kernel, no dense copy;
    the layer computes the kernel's reference, and the model stays near the exact one."""
    if not cpu_intdot.available():
        pytest.skip("the integer dot kernel does not build here")
    model, dense = _load(quantized, "gguf"), _load(quantized, "none")
    exact = _logits(dense)
    prepack_for_cpu(model, torch.float32)
    layers = _experts(model)
    for m, d in zip(layers, _experts(dense), strict=True):
        assert not hasattr(m, "w13") and not hasattr(m, "gguf_blocks")
        w13, w2 = m.cpu_experts  # stacked over the 4 experts
        assert (w13.bits, w2.bits, w13.codes.shape[0], w2.codes.shape[0]) == (4, 8, 4, 4)
        for e in range(4):  # each expert's gate then up rows, and its down rows, as loaded
            for w, want in ((w13, d.w13[e]), (w2, d.w2[e])):
                torch.testing.assert_close(cpu_intdot.dequantize(cpu_moe.expert(w, e)), want,
                                           rtol=1e-3, atol=1e-6)
    dense_bytes = sum(4 * 3 * m.num_experts * m.hidden_size * m.intermediate_size
                      for m in layers)
    assert held_bytes(layers) < 0.25 * dense_bytes  # 5 and 9 bits a weight, not 32
    got = _logits(model)
    assert ((got - exact).norm() / exact.norm()).item() < 0.05  # int8 activations
    # the layer against the kernel's reference, every expert run on its own rows
    m = layers[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, m.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(7)])
    weights = torch.rand(7, 2, generator=g)

    def ref(e: int, rows: torch.Tensor) -> torch.Tensor:
        w13, w2 = (cpu_moe.expert(w, e) for w in m.cpu_experts)
        h = moe_activation_ref(cpu_intdot.intdot_mm_ref(rows, w13), "silu")
        return cpu_intdot.intdot_mm_ref(h, w2)

    want = moe_by_expert(x, weights, ids, 4, ref)
    torch.testing.assert_close(m(x, weights, ids), want, rtol=1e-4, atol=1e-5)


def test_quantized_experts_in_the_engine_ignore_batching(quantized):
    """Greedy tokens of the CPU engine on the packed experts: the same alone, batched and in
    prefill chunks (the kernel's rows are independent of the batch)."""
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(5 + 4 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(ps, **kw):
        llm = LLM(quantized, device="cpu", quantization="gguf", dtype="float32", **kw)
        try:
            experts = _experts(llm.engine.executor.runner.model)
            assert all(hasattr(m, "cpu_experts") for m in experts) == cpu_intdot.available()
            return [o.outputs[0].token_ids for o in llm.generate(ps, params)]
        finally:
            llm.shutdown()

    batched = run(prompts)
    assert [run([p])[0] for p in prompts[:2]] == batched[:2]
    assert run(prompts, max_num_batched_tokens=5) == batched


@pytest.fixture(scope="module")
def all_quantized(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("moe") / "qwen3moe-qa.gguf")
    write(path, tiny("qwen3moe"), "qwen3moe", quant=True, quant_attn=True)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_runs_the_moe_layers(all_quantized, dtype):
    """The CPU decode step takes Qwen3-MoE's layers (q and k normed per head, the router, the
    experts on the integer dot kernel): a decode step's hidden states are the modules' (the
    Python form bit for bit, the C++ one within its sums' order), also for several
    sequences."""
    if not cpu_intdot.available():
        pytest.skip("the integer dot kernel does not build here")
    llm = LLM(all_quantized, device="cpu", quantization="gguf", dtype=dtype, max_model_len=128)
    try:
        model = llm.engine.executor.runner.model.model
        plan = model._cpu_decode_plan()
        assert plan is not None and all(lp.qk_norm is not None for lp in plan.layers)
        assert (plan.native is not None) == cpu_ext.available()
        # as many sequences as the Python form takes (the CPU plan's rows; 2 with AVX-512)
        for lens in ([7], [5, 12, 9][:plan.rows]):
            prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(n)] for i, n in enumerate(lens)]
            inp = _decode_inputs(llm, prompts)
            out = {}
            for name, p in (("modules", False), ("python", plan._replace(native=None)),
                            ("native", plan)):
                model._cpu_decode = p
                if p:
                    x = model.embed_tokens(inp.input_ids)
                    assert cpu_decode.usable(p, x, inp.attn)
                inp.attn.cpu_gather = None
                with torch.no_grad(), forward_context(inp.attn):  # rewrites the step's K/V
                    out[name] = model(inp.input_ids, inp.positions)
            model._cpu_decode = plan
            assert torch.equal(out["python"], out["modules"])
            # int8 activations: a flipped rounding moves a row ~1e-2
            a, b = out["native"].float(), out["modules"].float()
            assert ((a - b).norm() / b.norm()).item() < 3e-2
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, expert_parallel=True),
                                    dict(pipeline_parallel_size=2)], ids=["ep2", "pp2"])
def test_quantized_experts_across_ranks(quantized, layout):
    """Two gloo ranks holding packed experts (each its own with expert parallelism, each its
    layers' with pipeline parallelism) give one process's greedy tokens."""
    prompts = [[3 + (5 * i + 3 * j) % 90 for j in range(6 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    small = dict(device="cpu", quantization="gguf", dtype="float32", block_size=4,
                 num_blocks=48, max_model_len=96, distributed_timeout=60)
    tokens = []
    for kw in ({}, layout):
        llm = LLM(quantized, **small, **kw)
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantized_experts_on_a_gpu(quantized):
    """A GPU engine dequantizes the experts' blocks once for its MoE kernels: the greedy tokens
    of the model dequantized on the CPU (fp32). With --n-cpu-moe 2 both layers' experts stay
    packed in host memory and run on the CPU's integer dot kernel: the CPU engine's tokens."""
    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(5 + 4 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(**kw):
        llm = LLM(quantized, dtype="float32", max_model_len=128, **kw)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()

    gpu = dict(device="cuda", num_blocks=64, quantization="gguf")
    assert run(**gpu) == run(device="cpu", quantization="none")
    if cpu_intdot.available():
        assert run(**gpu, n_cpu_moe=2) == run(device="cpu", quantization="gguf")
