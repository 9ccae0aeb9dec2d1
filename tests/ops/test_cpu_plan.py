"""The CPU plan: each x86 family (simulated by patching the capability probe) gets its kernels
and defaults, and a GGUF layer served by the plan's layout matches its dequantized weights on
both of its paths (the int4 kernel for few rows, dense products for more)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from skyline.bench.gguf_blocks import random_blocks
from skyline.config import ConfigError
from skyline.engine.create import EngineArgs, create_engine_config
from skyline.ops import cpu_int4, cpu_intdot, cpu_linear, cpu_plan
from skyline.quant.gguf import GGUFLinearMethod

CAPS = {
    "amx": cpu_plan.CpuCaps("AVX512", avx512_bf16=True, amx_bf16=True, onednn_bf16=True),
    "avx512_bf16": cpu_plan.CpuCaps("AVX512", avx512_bf16=True, amx_bf16=False,
                                    onednn_bf16=True),
    # AVX-512 with VNNI but no BF16: oneDNN still packs bf16 (emulated), the plan does not
    "avx512": cpu_plan.CpuCaps("AVX512", avx512_bf16=False, amx_bf16=False, onednn_bf16=True),
    "avx2": cpu_plan.CpuCaps("AVX2", avx512_bf16=False, amx_bf16=False, onednn_bf16=False),
    "other": cpu_plan.CpuCaps("DEFAULT", avx512_bf16=False, amx_bf16=False, onednn_bf16=False),
}
NATIVE_BF16 = {"amx", "avx512_bf16"}


@pytest.fixture(params=list(CAPS))
def family(request, monkeypatch):
    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS[request.param])
    return request.param


def test_each_family_gets_its_plan(family):
    plan = cpu_plan.plan()
    assert plan.family == family
    # bfloat16 only where its products are native; the int4 kernel for decode-sized batches
    # on every x86 family (5- to 8-bit codes on it for no more rows than 4-bit ones); a CPU
    # torch has no vector kernels for keeps dense float32
    assert plan.dtype == (torch.bfloat16 if family in NATIVE_BF16 else torch.float32)
    x86 = family != "other" and cpu_int4.has_kernel()
    assert (plan.int4_rows > 0) == x86 and 0 <= plan.int4_wide_rows <= plan.int4_rows
    # the integer dot kernel on every x86 family where it builds; on AVX2 (no VNNI to make a
    # second rounding of the activations cheap) rounding them once, for more rows
    built = family != "other" and cpu_intdot.available()
    once = family == "avx2" and built
    assert plan.intdot_rows == (cpu_plan.ONCE_ROWS["avx2"][1] if once
                                else cpu_plan.INTDOT_ROWS if built else 0)
    assert plan.intdot_rounds == (1 if once else 2)
    assert plan.gguf_packed == (plan.int4_rows > 0 or plan.intdot_rows > 0)
    # 4-bit codes on the integer dot kernel on AVX2 (torch's int4 kernel's slow path there)
    assert plan.int4_kernel == ("intdot" if once else "int4")
    if once:
        assert plan.int4_rows == cpu_plan.ONCE_ROWS["avx2"][0]
    # the bf16 kernel for bfloat16 activations where it builds: the family's own, or those of a
    # bfloat16 model on AVX-512 without BF16 or AVX2 (beating oneDNN's emulation, F.linear)
    assert plan.bf16_rows == (cpu_plan.BF16_ROWS.get(family, 0) if built else 0)
    assert (plan.bf16_rows > 0) == (built and family != "other")


def test_a_bf16_capable_cpu_without_onednn_bf16_stays_float32():
    caps = cpu_plan.CpuCaps("AVX512", avx512_bf16=True, amx_bf16=True, onednn_bf16=False)
    assert cpu_plan.plan_for(caps).dtype == torch.float32
    # ATen's ISA lowered to AVX2 (ATEN_CPU_CAPABILITY=avx2): its AVX2 kernels are what run
    caps = cpu_plan.CpuCaps("AVX2", avx512_bf16=True, amx_bf16=False, onednn_bf16=True)
    assert cpu_plan.family(caps) == "avx2"


def test_the_real_probe_names_a_family():
    caps = cpu_plan.probe()
    assert cpu_plan.family(caps) in cpu_plan.FAMILIES
    assert caps.aten_isa == torch.backends.cpu.get_cpu_capability()


def test_engine_defaults_for_a_gguf_model(family):
    try:
        cfg, _ = create_engine_config(EngineArgs(device="cpu"))
    except ConfigError:
        pytest.skip("the default GGUF model is not installed")
    plan = cpu_plan.plan()
    assert cfg.model.dtype == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[plan.dtype]
    assert cfg.model.quant.method == ("gguf" if plan.gguf_packed else "none")
    # --dtype float32 is the exact path everywhere: blocks dequantized to float32 at load
    exact, _ = create_engine_config(EngineArgs(device="cpu", dtype="float32"))
    assert (exact.model.dtype, exact.model.quant.method) == ("float32", "none")
    # an explicit --quantization is kept
    packed, _ = create_engine_config(EngineArgs(device="cpu", dtype="float32",
                                                quantization="gguf"))
    assert packed.model.quant.method == "gguf"


@pytest.mark.parametrize("weights", ["BF16", "F16"])
def test_a_bf16_file_is_served_in_bfloat16_where_skyline_kernels_run_it(family, weights,
                                                                        tmp_path):
    """A BF16 GGUF file: bfloat16 where the products are native, and also where they are not
    but the bf16 kernel runs few rows and float32 GEMMs over slabs of the weight the others
    (AVX2: half the bytes of float32); elsewhere, and for an F16 file (exact in float32, not in
    bfloat16), the plan's dtype."""
    from gguf import GGMLQuantizationType

    from skyline.bench.random_gguf import TINY_DENSE, write_dense_gguf

    path = str(tmp_path / f"tiny-{weights}.gguf")
    write_dense_gguf(path, TINY_DENSE, GGMLQuantizationType[weights])
    cfg, _ = create_engine_config(EngineArgs(model=path, device="cpu"))
    plan = cpu_plan.plan()
    bf16 = plan.dtype == torch.bfloat16 or (weights == "BF16" and plan.bf16_rows > 0
                                            and not CAPS[family].onednn_bf16)
    assert cfg.model.dtype == ("bfloat16" if bf16 else "float32")
    assert bf16 == (family in NATIVE_BF16 or (
        weights == "BF16" and family == "avx2" and cpu_intdot.available()))
    # --dtype float32 stays the exact path
    exact, _ = create_engine_config(EngineArgs(model=path, device="cpu", dtype="float32"))
    assert exact.model.dtype == "float32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_bf16_checkpoint_is_served_in_bfloat16_where_it_runs_fastest(family, dtype, tmp_path):
    """An unquantized bfloat16 safetensors checkpoint: bfloat16 where the products are native
    and where skyline's kernels run bfloat16 weights without oneDNN (AVX2); float32 elsewhere,
    and for a float16 checkpoint (exact in float32, not in bfloat16)."""
    transformers = pytest.importorskip("transformers")
    from tests.conftest import TINY_LLAMA

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    model.to(dtype).save_pretrained(tmp_path, safe_serialization=True)
    cfg, _ = create_engine_config(EngineArgs(model=str(tmp_path), device="cpu"))
    avx2_kernel = family == "avx2" and cpu_intdot.available()
    bf16 = dtype == torch.bfloat16 and (family in NATIVE_BF16 or avx2_kernel)
    assert cfg.model.dtype == ("bfloat16" if bf16 else "float32")
    exact, _ = create_engine_config(EngineArgs(model=str(tmp_path), device="cpu",
                                               dtype="float32"))
    assert exact.model.dtype == "float32"


class _Layer(torch.nn.Module):
    """What GGUFLinearMethod needs of a Linear after loading: runs of raw blocks."""

    def __init__(self, runs: list[tuple[Q, torch.Tensor]], cols: int) -> None:
        super().__init__()
        self.gguf_types = [int(q) for q, _ in runs]
        for i, (_, data) in enumerate(runs):
            self.register_buffer(f"gguf_w{i}", data)
        self.bias = None
        self.in_features = cols
        self.out_features = sum(data.shape[0] for _, data in runs)


@pytest.mark.parametrize("runs", [[Q.Q4_1], [Q.Q4_0, Q.Q4_K], [Q.Q8_0], [Q.Q5_0, Q.Q4_1],
                                  [Q.Q6_K]], ids=lambda r: "+".join(q.name for q in r))
def test_served_layout_follows_the_plan_and_matches_the_blocks(family, runs):
    plan = cpu_plan.plan()
    dtype = plan.dtype
    if dtype == torch.bfloat16 and not cpu_linear.can_pack(torch.zeros(1, 1, dtype=dtype)):
        pytest.skip("this machine has no oneDNN bfloat16 products")
    layer = _Layer([(q, random_blocks(q, 32, 256, 7 + i)) for i, q in enumerate(runs)], 256)
    method = GGUFLinearMethod()
    w = method.dequantized_weight(layer)  # [32 * len(runs), 256] float32, exact
    assert method.prepack_cpu(layer, dtype)
    assert not hasattr(layer, "gguf_w0")  # the raw blocks are dropped
    four_bit = all(q in (Q.Q4_0, Q.Q4_1, Q.Q4_K) for q in runs)
    # wider codes on the integer dot kernel; 4-bit ones too where the plan says so (AVX2)
    intdot = (plan.int4_kernel == "intdot" and plan.int4_rows > 0 if four_bit
              else plan.intdot_rows > 0)
    want_rows = (plan.int4_rows if intdot and four_bit else plan.intdot_rows if intdot
                 else 0 if Q.Q6_K in runs else plan.int4_rows if four_bit
                 else plan.int4_wide_rows)
    assert layer.cpu_plane_rows == want_rows
    assert (layer.cpu_planes is not None) == (want_rows > 0 and not intdot)
    assert (layer.cpu_intdot is not None) == intdot
    if want_rows and not intdot:
        assert len(layer.cpu_planes) == (1 if four_bit else 2)
    for rows in sorted({1, max(want_rows, 1), want_rows + 1, 17}):
        x = torch.randn(rows, 256).to(dtype)
        y = method.apply(layer, x)
        assert y.dtype == dtype and y.shape == (rows, w.shape[0])
        ref = x.float() @ w.T
        # bf16 scales / weights / accumulation on both paths; float32 dense is exact
        tol = 2e-2 if dtype == torch.bfloat16 or rows <= want_rows else 1e-5
        assert (y.float() - ref).abs().max() / ref.abs().max() < tol, rows
    back = method.dequantized_weight(layer)
    assert (back - w).abs().max() / w.abs().max() < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_without_room_for_dense_copies_every_batch_takes_the_planes(monkeypatch):
    import skyline.quant.gguf as gguf_method

    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["avx512"])
    monkeypatch.setattr(gguf_method, "room_for", lambda nbytes: False)
    if not cpu_int4.has_kernel():
        pytest.skip("torch lacks the CPU int4 kernel")
    layer = _Layer([(Q.Q4_1, random_blocks(Q.Q4_1, 32, 256, 3))], 256)
    method = GGUFLinearMethod()
    w = method.dequantized_weight(layer)
    method.prepack_cpu(layer, torch.float32)
    assert layer.cpu_dense is None and layer.cpu_planes is not None
    x = torch.randn(40, 256)  # a prefill-sized batch
    ref = x @ w.T
    assert (method.apply(layer, x) - ref).abs().max() / ref.abs().max() < 2e-2
    assert (method.dequantized_weight(layer) - w).abs().max() / w.abs().max() < 1e-2


def test_the_rounding_count_can_be_set(monkeypatch):
    from skyline import envs

    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["avx2"])
    for value, want in (("2", 2), ("1", 1)):
        monkeypatch.setenv("SKYLINE_CPU_INTDOT_ROUNDS", value)
        monkeypatch.setattr(envs, "ENV", envs.Env.read())
        plan = cpu_plan.plan()
        assert plan.intdot_rounds == want
        if cpu_intdot.available():  # twice: the rows where two roundings still win
            assert (plan.int4_rows, plan.intdot_rows) == (
                cpu_plan.ONCE_ROWS["avx2"] if want == 1
                else (cpu_plan._PLANS["avx2"][1], cpu_plan.INTDOT_ROWS))
    monkeypatch.setenv("SKYLINE_CPU_INTDOT_ROUNDS", "3")
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    with pytest.raises(ValueError, match="SKYLINE_CPU_INTDOT_ROUNDS=3 must be 1 or 2"):
        cpu_plan.plan()


def test_one_rounding_moves_4_bit_codes_to_the_integer_dot_kernel(monkeypatch):
    """On AVX-512 BF16 the default plan keeps 4-bit codes on torch's int4 kernel and rounds
    twice; asked to round once, it runs them on the integer dot kernel, which is faster there
    rounded once, with 5- to 8-bit codes for the same rows. A family without measured rows
    (AMX) keeps torch's kernel."""
    from skyline import envs

    if not cpu_intdot.available():
        pytest.skip("the integer dot kernel does not build here")
    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["avx512_bf16"])
    plan = cpu_plan.plan()
    assert (plan.int4_kernel, plan.intdot_rounds, plan.intdot_rows) == (
        "int4", 2, cpu_plan.INTDOT_ROWS)
    monkeypatch.setenv("SKYLINE_CPU_INTDOT_ROUNDS", "1")
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    plan = cpu_plan.plan()
    assert (plan.int4_kernel, plan.intdot_rounds) == ("intdot", 1)
    assert (plan.int4_rows, plan.intdot_rows) == cpu_plan.ONCE_ROWS["avx512_bf16"]
    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["amx"])
    plan = cpu_plan.plan()
    assert (plan.int4_kernel, plan.intdot_rounds, plan.intdot_rows) == (
        "int4", 1, cpu_plan.INTDOT_ROWS)


def test_the_bf16_kernels_rows_can_be_set(monkeypatch):
    from skyline import envs

    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["avx512_bf16"])
    built = cpu_intdot.available()
    for value, want in (("3", 3), ("-1", 0), ("0", cpu_plan.BF16_ROWS["avx512_bf16"])):
        monkeypatch.setenv("SKYLINE_CPU_BF16_ROWS", value)
        monkeypatch.setattr(envs, "ENV", envs.Env.read())
        assert cpu_plan.plan().bf16_rows == (want if built else 0)
    # on AVX2 too (a bfloat16 model's activations there: --dtype bfloat16, a CPU stage)
    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["avx2"])
    monkeypatch.setenv("SKYLINE_CPU_BF16_ROWS", "-1")
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    assert cpu_plan.plan().bf16_rows == 0
    monkeypatch.setenv("SKYLINE_CPU_BF16_ROWS", "4")
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    assert cpu_plan.plan().bf16_rows == (4 if built else 0)


def test_a_tuned_plan_sets_the_bf16_kernels_rows(monkeypatch):
    from skyline.ops import tuning

    monkeypatch.setattr(cpu_plan, "probe", lambda: CAPS["avx512_bf16"])
    default = cpu_plan.BF16_ROWS["avx512_bf16"]
    for stored, want in (({"bf16_rows": 3}, 3), ({"bf16_rows": 0}, 0), ({}, default)):
        monkeypatch.setattr(tuning, "get_config", lambda *a, s=stored, **k: s)
        assert cpu_plan.plan().bf16_rows == (want if cpu_intdot.available() else 0)
    monkeypatch.setattr(tuning, "get_config", lambda *a, **k: {"bf16_rows": "two"})
    with pytest.raises(tuning.KernelConfigError, match="bf16_rows is 'two'"):
        cpu_plan.plan()
