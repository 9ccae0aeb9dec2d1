"""An unquantized bfloat16 model as a CPU engine serves it where the CPU plan has bf16_rows:
decode-sized batches on skyline's bf16 kernel (ops/cpu_bf16.py) over the plain weights kept
beside oneDNN's packed ones, through the C++ decode step; larger batches on oneDNN; the same
greedy tokens as oneDNN's products alone (up to a near tie)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from tiny_hf import save_scaled

from skyline import LLM, SamplingParams
from skyline.model.layers import cpu_decode
from skyline.model.layers.linear import Linear
from skyline.ops import cpu_bf16, cpu_ext, cpu_linear, cpu_plan, host_memory
from skyline.quant.method import PackedLinearMethod, UnquantizedLinearMethod, prepack, unpack

pytestmark = pytest.mark.skipif(not cpu_bf16.available(),
                                reason="needs skyline's CPU operations")
# oneDNN packs bfloat16 weights on AVX-512 and AMX, not on AVX2 (where the plain weights serve)
ONEDNN_BF16 = cpu_plan.probe().onednn_bf16
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN packs no bfloat16 here")

VOCAB = 512


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return save_scaled(transformers.LlamaForCausalLM(cfg), tmp_path_factory.mktemp("llama"))


def _llm(path: str, rows: int) -> LLM:
    plan = dataclasses.replace(cpu_plan.plan(), dtype=torch.bfloat16, bf16_rows=rows)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_plan, "plan", lambda: plan)
        return LLM(path, device="cpu", dtype="bfloat16", threads=1, max_model_len=256,
                   enable_prefix_caching=False)


@needs_onednn_bf16
def test_a_layer_keeps_its_plain_weight_for_few_rows():
    lin = Linear(64, 48, bias=True, linear_method=UnquantizedLinearMethod())
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    lin.to(torch.bfloat16)
    w = lin.weight.data.clone()
    assert prepack(lin, bf16_rows=2) and lin.bf16_rows == 2 and torch.equal(lin.bf16_weight, w)
    method = lin.linear_method
    assert isinstance(method, PackedLinearMethod)
    x = torch.randn(3, 64).bfloat16()
    # 1-2 rows: the kernel (plus the bias); 3: oneDNN's packed product
    assert torch.equal(method.apply(lin, x[:2]), cpu_bf16.bf16_mm(x[:2], w) + lin.bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), lin.bias.float())
    assert (method.apply(lin, x).float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert method.cpu_decode_product(lin) is None  # a bias: no C++ step
    assert method.decode_bytes(lin) == 64 * 48 * 2  # the plain copy, not also the packed one
    assert unpack(lin) and torch.equal(lin.weight, w) and not hasattr(lin, "bf16_weight")
    # without bf16_rows, packed only
    assert prepack(lin) and lin.bf16_weight is None


def test_decode_runs_the_kernel_with_the_same_greedy_tokens(llama, monkeypatch):
    prompts = [[5, 77, 300, 12, 9, 41], [100, 2, 3], [400, 401, 402, 403]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    kernel = _llm(llama, 2)
    try:
        model = kernel.engine.executor.runner.model.model
        proj = model.layers[0].self_attn.qkv_proj
        assert proj.bf16_weight is not None and proj.bf16_rows == 2
        assert kernel.engine.executor.runner.model.lm_head.bf16_rows == 2  # the head too
        if host_memory.available():  # streamed weights in one huge-page mapping per 64 MiB
            w = proj.bf16_weight
            assert w.untyped_storage().nbytes() > w.numel() * w.element_size()
            assert w.untyped_storage().data_ptr() == model.layers[-1].mlp.down_proj.bf16_weight \
                .untyped_storage().data_ptr()
        plan = model._cpu_decode_plan()
        assert plan is not None and (plan.native is not None) == cpu_ext.available()
        calls, steps = [], []
        real_mm, real_run = cpu_bf16.bf16_mm, cpu_decode.run
        monkeypatch.setattr(cpu_bf16, "bf16_mm", lambda *a: calls.append(1) or real_mm(*a))
        monkeypatch.setattr(cpu_decode, "run", lambda *a: steps.append(1) or real_run(*a))
        model._cpu_decode = plan._replace(native=None)  # the Python step calls the kernel
        python = [o.outputs[0].token_ids for o in kernel.generate(prompts[:2], params)]
        assert len(calls) >= 15 * (4 * 3 + 1)  # every decode step's 4 products a layer, head
        model._cpu_decode = plan
        runs = [[o.outputs[0].token_ids for o in kernel.generate(p, params)]
                for p in (prompts[:2], prompts)]  # 2 rows: the C++ step's kernel; 3: oneDNN
        assert len(steps) >= 3 * 15
    finally:
        kernel.shutdown()
    onednn = _llm(llama, 0)
    try:
        model = onednn.engine.executor.runner.model.model
        # oneDNN's packed products (F.linear's where it packs no bfloat16)
        assert getattr(model.layers[0].self_attn.qkv_proj, "bf16_weight", None) is None
        assert onednn.engine.executor.runner.model.lm_head.bf16_rows == 0
        want = [o.outputs[0] for o in onednn.generate(prompts, params)]
    finally:
        onednn.shutdown()
    for got in (python, *runs):
        _agree(got, want)
    # where oneDNN packs no bfloat16 (AVX2), the plain weights alone: the C++ step's kernel at
    # 2 rows, the wide product at 3
    with monkeypatch.context() as mp:
        mp.setattr(cpu_linear, "can_pack", lambda w: False)
        plain = _llm(llama, 2)
    try:
        model = plain.engine.executor.runner.model.model
        proj = model.layers[0].self_attn.qkv_proj
        assert proj.packed_weight is None and proj.bf16_weight is not None
        assert model._cpu_decode_plan().native is not None
        for p in (prompts[:2], prompts):
            _agree([o.outputs[0].token_ids for o in plain.generate(p, params)], want)
    finally:
        plain.shutdown()


def _agree(got: list[list[int]], want: list) -> None:
    for tokens, ref in zip(got, want, strict=False):
        pairs = enumerate(zip(tokens, ref.token_ids, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(tokens))
        if same < len(tokens):  # another sum order may only flip a near tie
            top = ref.logprobs[same]
            assert top.logprobs[1] - top.logprobs[2] < 0.15, (same, tokens, ref.token_ids)


def test_where_onednn_packs_no_bfloat16_the_plain_weight_serves_every_batch(monkeypatch):
    lin = Linear(64, 48, bias=False, linear_method=UnquantizedLinearMethod())
    with torch.no_grad():
        lin.weight.normal_()
    lin.to(torch.bfloat16)
    w = lin.weight.data.clone()
    monkeypatch.setattr(cpu_linear, "can_pack", lambda w: False)
    monkeypatch.setattr(cpu_bf16, "native_gemm", lambda: False)
    assert not prepack(lin)  # no rows for the kernel: left as loaded
    assert isinstance(lin.linear_method, UnquantizedLinearMethod)
    assert prepack(lin, bf16_rows=2) and lin.packed_weight is None
    method = lin.linear_method
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(method.apply(lin, x[:2]), cpu_bf16.bf16_mm(x[:2], w))
    # more rows: float32 GEMMs over the converted weight, not ATen's bfloat16 loop
    assert torch.equal(method.apply(lin, x), cpu_bf16.bf16_wide_mm(x, w))
    assert torch.equal(method.full_weight(lin), w)
    native = method.cpu_decode_product(lin)[2]
    assert native.dense is lin.bf16_weight and native.rows == 2
    assert unpack(lin) and torch.equal(lin.weight, w) and not hasattr(lin, "bf16_weight")


class _GGUFLayer(torch.nn.Module):
    """What GGUFLinearMethod.prepack_cpu needs of a Linear after loading: one run of blocks."""

    def __init__(self, qtype: int, data: torch.Tensor, rows: int, cols: int) -> None:
        super().__init__()
        self.gguf_types = [qtype]
        self.register_buffer("gguf_w0", data)
        self.bias = None
        self.out_features, self.in_features = rows, cols


@pytest.mark.parametrize("name", ["BF16", "F16"])
@pytest.mark.parametrize("rows", [2, 0])
@pytest.mark.parametrize("packable", [True, False], ids=["onednn", "plain"])
def test_16_bit_gguf_layers_take_the_kernel_by_the_plan(monkeypatch, name, rows, packable):
    """Beside oneDNN's packed weight, or on the plain one alone where oneDNN packs no bfloat16
    (AVX2)."""
    from gguf import GGMLQuantizationType as Q

    from skyline.quant.gguf import GGUFLinearMethod

    if packable and not ONEDNN_BF16:
        pytest.skip("oneDNN packs no bfloat16 here")
    plan = dataclasses.replace(cpu_plan.plan(), dtype=torch.bfloat16, bf16_rows=rows)
    monkeypatch.setattr(cpu_plan, "plan", lambda: plan)
    if not packable:
        monkeypatch.setattr(cpu_linear, "can_pack", lambda w: False)
    w = torch.randn(40, 96).to(torch.bfloat16 if name == "BF16" else torch.float16)
    layer = _GGUFLayer(int(Q[name]), w.view(torch.uint8), 40, 96)
    method = GGUFLinearMethod()
    assert method.prepack_cpu(layer, torch.bfloat16)
    assert layer.cpu_dense.is_mkldnn == packable
    if rows and not packable:
        assert layer.cpu_bf16 is layer.cpu_dense  # one copy
    assert method.decode_bytes(layer) == (40 * 96 * 2 if rows else None)  # one copy read
    dense = w.to(torch.bfloat16)
    x = torch.randn(3, 96).bfloat16()
    got = method.cpu_decode_product(layer)
    if not rows:  # oneDNN only, as before the kernel; no C++ step for the layer
        assert layer.cpu_bf16 is None and layer.cpu_plane_rows == 0 and got is None
        return
    assert torch.equal(layer.cpu_bf16, dense) and layer.cpu_plane_rows == 2
    assert torch.equal(method.apply(layer, x[:2]), cpu_bf16.bf16_mm(x[:2], dense))
    ref = x.float() @ dense.float().T
    assert (method.apply(layer, x).float() - ref).abs().max() < 0.02 * ref.abs().max()
    product, n, native = got
    assert native.kind == cpu_ext.BF16 and native.tensors[0] is layer.cpu_bf16
    assert native.rows == 2 and native.dense is layer.cpu_dense and n == cpu_ext.ANY_ROWS
    assert torch.equal(product(x[:1]), cpu_bf16.bf16_mm(x[:1], dense))


def test_a_16_bit_gguf_file_keeps_one_copy_of_its_plain_weights(tmp_path, monkeypatch):
    """Where oneDNN packs no bfloat16, a BF16 layer's plain weight serves every batch: moved
    into huge pages, it is still the one copy (it was once copied there beside the original)."""
    from skyline.bench.random_gguf import TINY_DENSE, write_dense_gguf

    path = str(tmp_path / "tiny.gguf")
    write_dense_gguf(path, TINY_DENSE)
    monkeypatch.setattr(cpu_linear, "can_pack", lambda w: False)
    llm = LLM(path, device="cpu", dtype="bfloat16", quantization="gguf", threads=1,
              max_model_len=128)
    try:
        layers = llm.engine.executor.runner.model.model.layers
        projs = [m for layer in layers for m in layer.modules() if hasattr(m, "cpu_bf16")]
        assert len(projs) == 4 * len(layers)
        for p in projs:
            assert p.cpu_bf16 is not None and p.cpu_dense is p.cpu_bf16
    finally:
        llm.shutdown()
