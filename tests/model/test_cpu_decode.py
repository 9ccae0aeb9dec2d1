"""layers/cpu_decode.py against the modules it stands in for: the default model as a CPU
engine serves it, with bfloat16 and with float32 activations, decode steps of one and of several
sequences (padded to the longest), the hidden states bit for bit (the C++ step: within its sums'
order) and the greedy tokens; and where it must not run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyline import LLM, SamplingParams
from skyline.config import ConfigError
from skyline.model.forward_ctx import forward_context
from skyline.model.layers import cpu_decode
from skyline.ops import cpu_ext, cpu_plan


# The activations' dtype of the CPU plan: bfloat16 (CPUs with bf16 units) or float32 (AVX2,
# AVX-512 without BF16); both are served on every machine here, the plan's dtype replaced.
@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32],
                ids=["bf16", "fp32"])
def llm(request):
    if not cpu_plan.plan().gguf_packed:
        pytest.skip("this CPU's plan keeps no GGUF blocks packed")
    plan = dataclasses.replace(cpu_plan.plan(), dtype=request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_plan, "plan", lambda: plan)
        try:
            llm = LLM(device="cpu", threads=1, enable_prefix_caching=False)
        except ConfigError:
            pytest.skip("the default GGUF model is not installed")
    assert llm.engine.executor.runner.model.model.embed_tokens.weight.dtype == request.param
    yield llm
    llm.shutdown()


def _decode_inputs(llm, prompts):
    """The inputs of the first decode step of `prompts`, as the runner built them."""
    runner = llm.engine.executor.runner
    seen = []
    forward = runner._forward

    def capture(inp):
        seen.append(inp)
        return forward(inp)

    runner._forward = capture
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    finally:
        runner._forward = forward
    return next(inp for inp in seen if inp.attn.num_decodes == len(prompts))


# b10: more sequences than the int4 kernel takes (the CPU plan's int4_rows, 8): the C++ step
# runs the layers' dense weights, as the modules do
@pytest.mark.parametrize("lens", [[1], [9], [5, 23, 17], [3 + 2 * i for i in range(10)]],
                         ids=lambda x: f"b{len(x)}")
def test_hidden_states_are_the_modules(llm, lens):
    model = llm.engine.executor.runner.model.model
    assert model._cpu_decode_plan() is not None
    prompts = [[(7 * j + 31 * i) % 4000 + 100 for j in range(n)] for i, n in enumerate(lens)]
    inp = _decode_inputs(llm, prompts)
    plan = model._cpu_decode
    # the C++ step where skyline's CPU operations build (ops/cpu_ext.py), and the Python one
    assert (plan.native is not None) == cpu_ext.available()
    variants = [("modules", False), ("python", plan._replace(native=None))]
    if plan.native is not None:
        variants.append(("native", plan))
        # the C++ step takes this batch (else the comparison below would be the modules')
        x = model.embed_tokens(inp.input_ids)
        assert cpu_decode.usable(plan, x, inp.attn)
    out = {}
    for name, p in variants:
        model._cpu_decode = p
        inp.attn.cpu_gather = None
        with torch.no_grad(), forward_context(inp.attn):  # rewrites the step's K/V: the same
            out[name] = model(inp.input_ids, inp.positions)
    model._cpu_decode = plan
    assert torch.equal(out["python"], out["modules"])
    if "native" in out:
        # attention's float32 sums in another order (within 1e-6; tests/ops/test_cpu_intdot.py),
        # else the same operations: a bfloat16 rounding that flips grows through 30 layers to
        # the size of bfloat16's own error against float32 (~1%); in float32 too, since the
        # products round x to bfloat16 (int4 planes) or int8 (the integer dot kernel), a last
        # bit that flips one of those roundings grows through the layers (~2e-3; an int8 step
        # of one rounding is bfloat16's size: ~2e-2)
        coarse = out["modules"].dtype == torch.bfloat16 or cpu_plan.plan().intdot_rounds == 1
        bound = 3e-2 if coarse else 1e-2
        a, b = out["native"].float(), out["modules"].float()
        assert ((a - b).norm() / b.norm()).item() < bound


# the smallest gap between the modules' two likeliest tokens at which the step may choose the
# other: its sums run in another order, and in a product that rounds x (to bfloat16 for int4
# planes, to int8 for the integer dot kernel) a flipped last bit grows through the layers
NEAR_TIE = 0.15


def test_greedy_tokens_are_the_modules(llm, monkeypatch):
    model = llm.engine.executor.runner.model.model
    plan = model._cpu_decode_plan()
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [504, 3575, 282, 4649, 314]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = []
    real_run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: runs.append(1) or real_run(*a))
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len(runs) >= 23
    model._cpu_decode = False
    try:
        modules = [o.outputs[0] for o in llm.generate(prompts, params)]
    finally:
        model._cpu_decode = plan
    for tokens, want in zip(fast, modules, strict=True):
        # identical, or identical up to a near tie of the modules' (after which the two
        # continue from different tokens)
        pairs = enumerate(zip(tokens, want.token_ids, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(tokens))
        if same < len(tokens):
            top = want.logprobs[same]  # the sampled token, then the two likeliest
            gap = top.logprobs[1] - top.logprobs[2]
            assert same > 0 and gap < NEAR_TIE, (same, gap, tokens, want.token_ids)


def test_not_usable_with_hooks_prefill_or_many_rows(llm):
    model = llm.engine.executor.runner.model.model
    plan = model._cpu_decode_plan()
    inp = _decode_inputs(llm, [[100, 200]])
    dtype = model.embed_tokens.weight.dtype
    x = torch.zeros(1, 576, dtype=dtype)
    assert cpu_decode.usable(plan, x, inp.attn)
    assert not cpu_decode.usable(plan, x, None)  # no forward context
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert not cpu_decode.usable(plan, x.to(other), inp.attn)  # not the KV cache's dtype
    assert not cpu_decode.usable(plan, x.half(), inp.attn)
    python = plan._replace(native=None)
    rows = torch.zeros(plan.rows + 1, 576, dtype=dtype)
    inp.attn.num_decodes = rows.shape[0]
    assert not cpu_decode.usable(python, rows, inp.attn)  # more rows than a product takes
    # the C++ step takes them where every product has a dense weight
    assert cpu_decode.usable(plan, rows, inp.attn) == (plan.native is not None)
    inp.attn.num_decodes = 1
    handle = model.layers[3].mlp.down_proj.register_forward_pre_hook(lambda m, a: None)
    try:
        assert not cpu_decode.usable(plan, x, inp.attn)
    finally:
        handle.remove()
    assert cpu_decode.usable(plan, x, inp.attn)


def test_a_pipeline_stage_runs_its_own_layers(llm):
    """A later pipeline stage (model/partition.py: SkipLayers stand in for the layers before
    it) plans the step over the layers it holds, and computes what its modules compute."""
    from skyline.model.layers.stage import SkipLayer

    model = llm.engine.executor.runner.model.model
    whole = model._cpu_decode_plan()
    inp = _decode_inputs(llm, [[100, 200, 300], [400, 500]])
    layers = list(model.layers)
    try:
        for i in range(20):
            model.layers[i] = SkipLayer()
        model._cpu_decode = None
        stage = model._cpu_decode_plan()
        assert stage is not None and len(stage.layers) == len(layers) - 20
        assert (stage.native is not None) == (whole.native is not None)
        assert stage.layers[0].attn is layers[20].self_attn.attn
        out = {}
        for name, p in (("modules", False), ("plan", stage)):
            model._cpu_decode = p
            inp.attn.cpu_gather = None
            with torch.no_grad(), forward_context(inp.attn):
                out[name] = model(inp.input_ids, inp.positions).float()
        if stage.native is None:
            assert torch.equal(out["plan"], out["modules"])
        else:  # the C++ step's sums in another order (test_hidden_states_are_the_modules)
            assert ((out["plan"] - out["modules"]).norm() / out["modules"].norm()).item() < 3e-2
    finally:
        for i, layer in enumerate(layers):
            model.layers[i] = layer
        model._cpu_decode = whole


def test_a_float32_checkpoint_decodes_through_the_step(tiny_llama):
    """A float32 model's oneDNN-packed layers: its decode steps run the plan (from C++ where
    skyline's CPU operations build: attention read from the paged cache in place), the modules'
    hidden states (the Python step bit for bit, the C++ one within its sums' order) and their
    greedy tokens."""
    from skyline.ops import cpu_linear

    if not cpu_linear.can_pack(torch.zeros(1, 1)):
        pytest.skip("oneDNN packs no float32 weights here")
    llm = LLM(model=tiny_llama(), device="cpu", threads=1, enable_prefix_caching=False)
    try:
        model = llm.engine.executor.runner.model.model
        assert model.cpu_decode_step() == ("native" if cpu_ext.available() else "python")
        prompts = [[(7 * j + 31 * i) % 300 + 5 for j in range(n)] for i, n in enumerate([5, 9])]
        inp = _decode_inputs(llm, prompts)
        x = model.embed_tokens(inp.input_ids)
        assert cpu_decode.usable(model._cpu_decode, x, inp.attn)
        out, plan = {}, model._cpu_decode
        for name, p in (("modules", False), ("python", plan._replace(native=None)),
                        ("native", plan)):
            model._cpu_decode = p
            inp.attn.cpu_gather = None
            with torch.no_grad(), forward_context(inp.attn):
                out[name] = model(inp.input_ids, inp.positions)
        model._cpu_decode = plan
        assert torch.equal(out["python"], out["modules"])
        a, b = out["native"], out["modules"]
        assert ((a - b).norm() / b.norm()).item() < 1e-5
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        planned = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        model._cpu_decode = False
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == planned
        model._cpu_decode = plan
    finally:
        llm.shutdown()
