"""SKYLINE_UNFUSE: the list is parsed strictly, and each fusion's modular form (the one the
variable selects, to measure what the fusion buys: bench/fused_vs_modular.py) computes what
the fused kernel computes. The forms built from Triton kernels run in Triton's interpreter on
CPU (tests/conftest.py); the dispatch under each name needs CUDA."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from skyline import envs
from skyline.model.layers.linear import Linear
from skyline.worker import queries

triton = pytest.importorskip("triton")

from skyline.ops.kv_write import KVWrite  # noqa: E402
from skyline.ops.norm import fused_add_rms_norm_triton, fused_add_rms_norm_unfused  # noqa: E402
from skyline.ops.rotary import rotary_triton, rotary_unfused  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def unfusing(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, unfuse=frozenset(names)))


def test_the_list_is_parsed_and_unknown_names_refused(monkeypatch):
    assert envs.parse_unfuse("") == envs.parse_unfuse("none") == frozenset()
    assert envs.parse_unfuse(" norm, silu,,argmax ") == {"norm", "silu", "argmax"}
    assert envs.parse_unfuse(",".join(envs.FUSIONS)) == set(envs.FUSIONS)
    with pytest.raises(ValueError, match="unknown fusions nrom, swiglu; the known ones are "
                                         "norm, rope_kv"):
        envs.parse_unfuse("silu,swiglu,nrom")
    monkeypatch.setenv("SKYLINE_UNFUSE", "rope_kv,pdl")
    assert envs.Env.read().unfuse == {"rope_kv", "pdl"}
    monkeypatch.setenv("SKYLINE_UNFUSE", "everything")
    with pytest.raises(ValueError, match="SKYLINE_UNFUSE"):
        envs.Env.read()
    monkeypatch.delenv("SKYLINE_UNFUSE")
    assert envs.Env.read().unfuse == frozenset()  # the default: every fusion


def test_the_engine_query_switches_the_process(monkeypatch):
    monkeypatch.setattr(envs, "ENV", envs.ENV)  # restored afterwards
    assert queries.unfuse(SimpleNamespace(graphs=None), ["silu", "norm"]) == 0.0
    assert envs.ENV.unfuse == {"silu", "norm"}
    queries.unfuse(SimpleNamespace(graphs=None), [])
    assert envs.ENV.unfuse == frozenset()
    with pytest.raises(ValueError, match="the known ones are"):
        queries.unfuse(SimpleNamespace(graphs=None), ["fused"])


def test_an_engine_gives_the_setting_back_at_shutdown(monkeypatch, tiny_llama):
    # The query swaps a process-wide setting: the next engine of the same process must not
    # start with the last one's measurement still unfused.
    from skyline.engine.frontend.llm import LLM

    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, unfuse=frozenset({"pdl"})))
    llm = LLM(tiny_llama(), device="cpu", kv_cache_memory="8MiB", max_model_len=128)
    try:
        llm.query("unfuse", ["silu", "norm"])
        assert envs.ENV.unfuse == {"silu", "norm"}
    finally:
        llm.shutdown()
    assert envs.ENV.unfuse == {"pdl"}  # as it was when the engine started


def test_act_quant_leaves_quantizing_to_the_linear(monkeypatch):
    layer = Linear(32, 8)
    layer.linear_method = SimpleNamespace(input_quant=lambda lin, x: "int8")
    x = torch.zeros(1, 32)
    assert layer.input_quant(x) == "int8"
    unfusing(monkeypatch, "act_quant")
    assert layer.input_quant(x) is None


# (int8 in float32 only: in bfloat16 the interpreter's truncated sums move a chunk's scale)
@pytest.mark.parametrize("dtype,quant", [(torch.float32, None), (torch.bfloat16, None),
                                         (torch.float32, "int8")])
def test_norm_unfused_equals_fused(dtype, quant):
    # torch's add then the plain RMSNorm kernel against the one kernel doing both
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 96, generator=g) * 3).to(DEV, dtype)
    res = torch.randn(5, 96, generator=g).to(DEV, dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(DEV, dtype)
    got, got_res = fused_add_rms_norm_unfused(x, res, w, 1e-6, quant)
    assert got_res.data_ptr() != res.data_ptr()  # new tensors: the inputs are left alone
    want, want_res = fused_add_rms_norm_triton(x.clone(), res.clone(), w, 1e-6, quant=quant)
    # one rounding of the sum to the dtype both ways (equal on a GPU; Triton's interpreter
    # truncates float32 -> bfloat16 where torch rounds to nearest)
    torch.testing.assert_close(got_res, want_res, atol=TOL[dtype], rtol=TOL[dtype])
    if quant is None:
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])
    else:  # the same rows rounded alike
        torch.testing.assert_close(got.floats, want.floats, atol=TOL[dtype], rtol=TOL[dtype])
        assert (got.words != want.words).float().mean() < 0.02


@pytest.mark.parametrize("unfuse", [{"rope_kv"}, {"qk_norm"}, {"qk_norm", "rope_kv"}],
                         ids=lambda u: "+".join(sorted(u)))
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm_rope"])
def test_rotary_unfused_equals_fused(unfuse, norm):
    # The rotary kernel that also norms q/k and writes the cache, against the RMSNorm kernel,
    # the rotary kernel and write_kv's kernel, as the names split them
    from skyline.model.layers.rotary import RotaryEmbedding

    t, h, kvh, d, page, blocks = 6, 4, 2, 16, 4, 5
    g = torch.Generator().manual_seed(7)
    with torch.device(DEV):
        cos_sin = RotaryEmbedding(d, 256, 10000.0).cos_sin_cache
    positions = torch.randint(0, 256, (t,), generator=g).to(DEV)
    slots = torch.randperm(blocks * page, generator=g)[:t].to(DEV)
    w = (torch.rand(2, d, generator=g) + 0.5).to(DEV)
    qkv0 = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(DEV)
    args = (w[0], w[1], 1e-6) if norm else (None, None, 0.0)
    runs = []
    for form in ("fused", "unfused"):
        qkv = qkv0.clone()
        q, k, v = (p.unflatten(-1, (-1, d)) for p in qkv.split([h * d, kvh * d, kvh * d], -1))
        cache = torch.zeros(2, blocks, page, kvh, d, device=DEV)
        kv = KVWrite(v, cache, slots)
        if form == "fused":
            q, k = rotary_triton(positions, q, k, cos_sin, *args, kv=kv)
        else:
            q, k = rotary_unfused(positions, q, k, cos_sin, *args, kv=kv, unfuse=frozenset(unfuse))
        runs.append((q, k, cache))
    (q_a, k_a, cache_a), (q_b, k_b, cache_b) = runs
    torch.testing.assert_close(q_b, q_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_b, k_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_b, cache_a, atol=1e-5, rtol=1e-5)
    assert cache_b.abs().sum() > 0


CUDA = pytest.mark.skipif(DEV == "cpu", reason="the dispatch under SKYLINE_UNFUSE is CUDA's")


@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["norm", "silu", "argmax", "nucleus", "moe_route"])
def test_dispatch_takes_the_modular_form_with_the_same_result(monkeypatch, name):
    from skyline.ops.activation import silu_and_mul
    from skyline.ops.argmax import argmax
    from skyline.ops.moe_route import route
    from skyline.ops.norm import fused_add_rms_norm
    from skyline.ops.nucleus import nucleus_draw

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4096, generator=g).to(DEV, torch.bfloat16)
    res = torch.randn(64, 4096, generator=g).to(DEV, torch.bfloat16)
    w = torch.rand(4096, generator=g).to(DEV, torch.bfloat16) + 0.5
    logits = torch.randn(64, 4096, generator=g).to(DEV) * 4  # float32: no ties
    noise = torch.empty(64, 4096).exponential_(generator=g).to(DEV)
    calls = {
        "norm": lambda: fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5),
        "silu": lambda: silu_and_mul(x),
        "argmax": lambda: argmax(x.float()),
        "nucleus": lambda: nucleus_draw(logits, torch.full((64,), 0.9, device=DEV), noise),
        "moe_route": lambda: route(logits[:, :128], 8, "softmax_renorm"),  # no tied scores
    }
    fused = calls[name]()
    unfusing(monkeypatch, name)
    modular = calls[name]()
    for a, b in zip(fused if isinstance(fused, tuple) else (fused,),
                    modular if isinstance(modular, tuple) else (modular,), strict=True):
        if a.dtype == torch.int64:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2)


@CUDA
@pytest.mark.cuda
def test_pdl_off_under_its_name(monkeypatch):
    from skyline.ops.pdl import use_pdl

    unfusing(monkeypatch, "pdl")
    assert not use_pdl(torch.device("cuda"))


@CUDA
@pytest.mark.cuda
def test_an_engine_unfused_generates_the_same_tokens(monkeypatch):
    # Every fusion in its modular form, switched on a running engine (CUDA graphs captured
    # again): the same greedy tokens as fused, in float32
    from skyline.bench.smoke import tiny_model
    from skyline.engine.frontend.llm import LLM
    from skyline.types import SamplingParams

    monkeypatch.setattr(envs, "ENV", envs.ENV)  # restored afterwards
    llm = LLM(tiny_model(), load_format="dummy", max_model_len=256, max_num_seqs=4)
    prompts = [[5, 9, 30, 7, 100, 3], [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    try:
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.query("unfuse", list(envs.FUSIONS), [1, 2, 4]) > 0  # graphs captured again
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == fused
    finally:
        llm.shutdown()


@CUDA
@pytest.mark.cuda
def test_capturing_again_keeps_cached_prefixes(monkeypatch):
    # The query captures every graph again after steps ran: a cached prompt's K/V must come
    # through it (each shape's warm-up forward once wrote into the last steps' slots, the
    # prompt's among them: its prefill ran in a mixed graph).
    from skyline.bench.smoke import tiny_model
    from skyline.engine.frontend.llm import LLM
    from skyline.types import SamplingParams

    monkeypatch.setattr(envs, "ENV", envs.ENV)  # restored afterwards
    llm = LLM(tiny_model(), load_format="dummy", max_model_len=256, max_num_seqs=4)
    prompt = [[(7 * i) % 200 + 3 for i in range(100)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    try:
        first = llm.generate(prompt, params)[0]
        llm.query("unfuse", [])  # nothing unfused: the same kernels, captured again
        again = llm.generate(prompt, params)[0]
        assert again.num_cached_tokens > 0  # the prompt's blocks came from the prefix cache
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.shutdown()
