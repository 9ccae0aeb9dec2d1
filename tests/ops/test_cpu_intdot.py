"""The CPU integer dot-product kernel (ops/cpu_intdot.py) against its reference, its layouts,
and the GGUF layers and LM head that run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from skyline.ops import cpu_intdot

needs_kernel = pytest.mark.skipif(not cpu_intdot.available(),
                                  reason="the integer dot kernel does not build here")


def _weight(n: int, k: int, bits: int, group: int, seed: int = 0, rounds: int = 2
            ) -> cpu_intdot.IntDotWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    codes[0, 0] = (1 << bits) - 1  # the widest code, so that pack keeps `bits`
    scale = torch.rand(n, k // group, generator=g) * 0.02
    offset = torch.randn(n, k // group, generator=g) * 0.05
    w = cpu_intdot.pack(codes, scale, offset, group, rounds)
    assert w is not None and w.bits == bits and w.shape == (n, k) and w.rounds == rounds
    assert torch.equal(cpu_intdot.unpack_codes(w), codes)
    return w


@needs_kernel
@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (1, 48, 576), (2, 32, 96), (3, 40, 1536),
                                   (8, 24, 64), (9, 16, 128), (17, 8, 192)])
def test_kernel_matches_reference(rounds: int, bits: int, group: int, m: int, n: int, k: int
                                  ) -> None:
    w = _weight(n, k, bits, group, rounds=rounds)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0  # a block of zeros: scale 0
    y = cpu_intdot.intdot_mm(x, w)
    ref = cpu_intdot.intdot_mm_ref(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    yb = cpu_intdot.intdot_mm(x.bfloat16(), w)  # bf16 in, rounded once on the way out
    refb = cpu_intdot.intdot_mm_ref(x.bfloat16(), w)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), refb.float(), rtol=1e-2, atol=1e-2)


def _super_weight(n: int, k: int, bits: int, group: int, seed: int = 0, rounds: int = 2
                  ) -> cpu_intdot.IntDotWeight:
    """A weight whose scales are int8 per group times a float16 factor per 256 elements (GGUF's
    K types' kind)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    codes[0, 0] = (1 << bits) - 1
    sub_scale = torch.randint(-128, 128, (n, k // group), generator=g)
    sub_offset = torch.randint(-128, 128, (n, k // group), generator=g)
    scale_d = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    offset_d = (-torch.rand(n, k // 256, generator=g) * 1e-3).half().float()
    w = cpu_intdot.pack_super(codes, sub_scale, scale_d, sub_offset, offset_d, group, rounds)
    assert w is not None and w.scale.dtype == torch.int8 and w.shape == (n, k)
    scale, offset = cpu_intdot.group_scales(w)  # factor times integer, exactly
    per_group = scale_d.repeat_interleave(256 // group, 1)
    assert torch.equal(scale, per_group * sub_scale.float())
    assert torch.equal(offset, offset_d.repeat_interleave(256 // group, 1) * sub_offset.float())
    return w


@needs_kernel
@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("m,n,k", [(1, 48, 512), (2, 24, 256), (3, 40, 1536), (9, 16, 768)])
def test_kernel_matches_reference_with_super_block_scales(rounds, bits, group, m, n, k):
    w = _super_weight(n, k, bits, group, rounds=rounds)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 3
    y = cpu_intdot.intdot_mm(x, w)
    ref = cpu_intdot.intdot_mm_ref(x, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # with power-of-two factors every group's scale and offset is a float16 too: the weight
    # packed with float16 scales per group gives the same sums
    codes, groups = cpu_intdot.unpack_codes(w), k // group
    two = torch.full((n, k // 256), 2.0 ** -12)
    wp = cpu_intdot.pack_super(codes, w.scale[:, :groups].long(), two,
                               w.offset[:, :groups].long(), -two, group, rounds)
    wf = cpu_intdot.pack(codes, *cpu_intdot.group_scales(wp), group, rounds)
    assert wf.scale.dtype == torch.float16 and wf.bits == wp.bits
    torch.testing.assert_close(cpu_intdot.intdot_mm(x, wf), cpu_intdot.intdot_mm(x, wp),
                               rtol=0, atol=0)


@needs_kernel
def test_pack_super_refuses_what_the_kernel_cannot_take() -> None:
    codes = torch.zeros(2, 512, dtype=torch.uint8)
    ints, d = torch.ones(2, 16, dtype=torch.int16), torch.full((2, 2), 0.5)
    assert cpu_intdot.pack_super(codes, ints, d, ints, d, 32) is not None
    assert cpu_intdot.pack_super(codes[:, :480], ints[:, :15], d[:, :1], ints[:, :15],
                                 d[:, :1], 32) is None  # K not whole super-blocks
    assert cpu_intdot.pack_super(codes, ints * 200, d, ints, d, 32) is None  # past int8
    assert cpu_intdot.pack_super(codes, ints, d + 1e-4, ints, d, 32) is None  # not a float16
    w = cpu_intdot.pack_super(codes, ints, d, ints, d, 32)
    with pytest.raises(RuntimeError, match="int8"):
        bad = w._replace(scale=w.scale[:, :-2].contiguous(), offset=w.offset[:, :-2].contiguous())
        cpu_intdot.intdot_mm(torch.zeros(1, 512), bad)


@needs_kernel
@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("bits,group", [(4, 32), (6, 16), (6, 32), (8, 32)])
def test_rows_are_independent_of_the_batch(rounds: int, bits: int, group: int) -> None:
    # a decode row's logits do not depend on the rows beside it (passes of up to 8 virtual
    # rows share loads; one row has its own loops)
    w = _weight(64, 576, bits, group, rounds=rounds)
    x = torch.randn(11, 576)
    full = cpu_intdot.intdot_mm(x, w)
    for i in range(11):
        torch.testing.assert_close(cpu_intdot.intdot_mm(x[i : i + 1].contiguous(), w),
                                   full[i : i + 1], rtol=0, atol=0)


def test_activation_rounding_is_per_32_and_twice() -> None:
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 32] = 127.0, 0.6, 1e-3  # the second block keeps its own scale
    once = cpu_intdot.round_int8_ref(x)
    assert once[0, 0] == 127 and once[0, 1] == 1 and once[0, 32] == pytest.approx(1e-3)
    assert torch.equal(cpu_intdot.quantize_activations_ref(x, rounds=1), once)
    twice = cpu_intdot.quantize_activations_ref(x)  # + the rounding of what once left
    assert twice[0, 1] == pytest.approx(0.6, abs=1e-6)
    y = torch.randn(8, 576) * torch.rand(8, 576).pow(4) * 20  # outliers, as activations have
    err_once = (cpu_intdot.round_int8_ref(y) - y).abs().max()
    err_twice = (cpu_intdot.quantize_activations_ref(y) - y).abs().max()
    assert err_twice < err_once / 100


@needs_kernel
@pytest.mark.parametrize("bits", [6, 8])
def test_the_kernel_rounds_activations_as_the_reference(bits: int) -> None:
    # bfloat16 activations put many elements on a rounding tie; the second round's steps are
    # ~1/254 of the first's, so what the first left must be rounded exactly as the reference
    # does (once, as an fma) or a code moves by one and a product by ~1e-5 of its magnitude
    torch.manual_seed(0)
    w = cpu_intdot.quantize_weight(torch.randn(256, 64), rounds=2, bits=bits)
    x = torch.randn(600, 64).bfloat16().float()
    got = cpu_intdot.intdot_mm(x, w).double()
    ref = cpu_intdot.intdot_mm_ref(x, w).double()
    scale = cpu_intdot.quantize_activations_ref(x).abs().double() @ \
        cpu_intdot.dequantize(w).abs().double().t()
    assert ((got - ref).abs() / scale).max() < 2e-6  # float32 sums of 64 products


@needs_kernel
def test_quantize_weight_is_q8_0() -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    q = cpu_intdot.quantize_weight(w)
    assert q is not None and q.bits == 8 and q.group == 32
    back = cpu_intdot.dequantize(q)
    step = w.reshape(32, 4, 32).abs().amax(-1, keepdim=True) / 127
    # half a step, and a little more where the refitted scale came out below amax / 127 and
    # the largest element's code stopped at 127
    err = (back - w).reshape(32, 4, 32).abs()
    assert (err <= step * 0.75).all() and err.mean() <= (step * 0.26).mean()


@needs_kernel
def test_quantize_weight_in_six_bits() -> None:
    """6-bit codes from each block's minimum, scale and offset refitted: within ~half a step of
    the block's range / 63; a block of one value is kept exactly."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    w[3, :32] = 0.25
    q = cpu_intdot.quantize_weight(w, bits=6)
    assert q is not None and q.bits == 6 and q.group == 32
    assert q.codes.shape == (32, 96)  # 24 bytes a block
    back = cpu_intdot.dequantize(q)
    blocks = w.reshape(32, 4, 32)
    step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 63
    err = (back - w).reshape(32, 4, 32).abs()
    assert (err <= step * 0.75 + 1e-6).all() and err.mean() <= (step * 0.3).mean()
    assert torch.equal(back[3, :32], w[3, :32])
    with pytest.raises(ValueError, match="6 or 8 bits"):
        cpu_intdot.quantize_weight(w, bits=4)


@needs_kernel
def test_pack_refuses_what_the_kernel_cannot_take() -> None:
    codes = torch.zeros(4, 48, dtype=torch.uint8)
    assert cpu_intdot.pack(codes, torch.ones(4, 3), torch.zeros(4, 3), 16) is None  # K % 32
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    assert cpu_intdot.pack(codes, torch.ones(4, 1), torch.zeros(4, 1), 64) is None  # group
    big = torch.full((4, 2), 1e6)  # past float16
    assert cpu_intdot.pack(codes, big, torch.zeros(4, 2), 32) is None
    with pytest.raises(RuntimeError, match="contiguous"):
        w = cpu_intdot.pack(codes, torch.ones(4, 2), torch.zeros(4, 2), 32)
        cpu_intdot.intdot_mm(torch.zeros(64, 2).t(), w)


_VARIANT = """
import torch
from skyline.ops import cpu_intdot
assert cpu_intdot.available()
print(cpu_intdot.isa())
g = torch.Generator().manual_seed(0)
for bits, group in ((4, 32), (4, 16), (6, 32), (6, 16), (8, 32), (8, 16)):
    for m, k, rounds in ((1, 576, 2), (5, 96, 2), (1, 576, 1), (11, 96, 1)):
        codes = torch.randint(0, 1 << bits, (24, k), generator=g, dtype=torch.uint8)
        codes[0, 0] = (1 << bits) - 1
        w = cpu_intdot.pack(codes, torch.rand(24, k // group, generator=g),
                            torch.randn(24, k // group, generator=g), group, rounds)
        x = torch.randn(m, k, generator=g)
        ref = cpu_intdot.intdot_mm_ref(x, w)
        torch.testing.assert_close(cpu_intdot.intdot_mm(x, w), ref, rtol=1e-5,
                                   atol=1e-5 * ref.abs().max().item())
    # scales as int8 times a float16 factor per 256 elements
    ints = torch.randint(-128, 128, (2, 24, 512 // group), generator=g, dtype=torch.int16)
    d = torch.rand(2, 24, 2, generator=g).half().float()
    w = cpu_intdot.pack_super(codes[:, :1].repeat(1, 512), ints[0], d[0], ints[1], d[1], group)
    x = torch.randn(3, 512, generator=g)
    ref = cpu_intdot.intdot_mm_ref(x, w)
    torch.testing.assert_close(cpu_intdot.intdot_mm(x, w), ref, rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())
# the bfloat16 kernel of the same build (ops/cpu_bf16.py): tails, batch invariance
from skyline.ops import cpu_bf16
for m, k, n in ((1, 576, 40), (11, 77, 9), (3, 2100, 10)):  # short rows, tails, long rows
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    y, ref = cpu_bf16.bf16_mm(x, w).float(), cpu_bf16.bf16_mm_ref(x, w).float()
    bound = x.float().abs() @ w.float().abs().T
    assert ((y - ref).abs() <= 2**-7 * ref.abs() + 1e-5 * bound).all()
    assert torch.equal(cpu_bf16.bf16_mm(x[-1:], w), cpu_bf16.bf16_mm(x, w)[-1:])
print(cpu_bf16.isa())
"""


# the CPU flags a build for each -march needs to run (a build for more than the CPU has dies
# by SIGILL at its first such instruction)
_MARCH_FLAGS = {"skylake-avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"},
                "haswell": {"avx2", "fma", "bmi2"}, "x86-64": set()}


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f
                     if line.startswith("flags")), set())


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("march,isas", [("skylake-avx512", ["avx2", "avx512"]),
                                        ("haswell", ["avx2", "avx2"]),
                                        ("x86-64", ["scalar", "scalar"])])
def test_builds_without_vnni_or_bf16_match_the_reference(march: str, isas: list[str]) -> None:
    """The integer dot kernel's and the bfloat16 kernel's paths without AVX-512 VNNI or BF16:
    AVX-512F (the bf16 kernel's; the integer dot kernel's AVX2 path there), AVX2, scalar; each
    where this CPU can run it."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86 builds")
    missing = _MARCH_FLAGS[march] - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run a {march} build (no {', '.join(sorted(missing))})")
    env = dict(os.environ, SKYLINE_CPU_INTDOT_MARCH=march)
    out = subprocess.run([sys.executable, "-c", _VARIANT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == isas


def test_without_the_kernel_the_plan_keeps_torch_kernels() -> None:
    code = ("from skyline.ops import cpu_intdot, cpu_plan; "
            "assert not cpu_intdot.available(); print(cpu_plan.plan().intdot_rows)")
    env = dict(os.environ, SKYLINE_CPU_INTDOT="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0"


class _Layer(torch.nn.Module):
    """What GGUFLinearMethod.prepack_cpu needs of a Linear after loading: runs of raw blocks."""

    def __init__(self, runs: list, rows: int, cols: int) -> None:
        super().__init__()
        self.gguf_types = [int(q) for q, _ in runs]
        for i, (_, data) in enumerate(runs):
            self.register_buffer(f"gguf_w{i}", data)
        self.bias = None
        self.out_features, self.in_features = rows, cols


@needs_kernel
@pytest.mark.parametrize("runs", [["Q8_0"], ["Q5_0"], ["Q6_K"], ["Q4_K", "Q6_K"],
                                  ["Q5_1", "Q8_0"]], ids="+".join)
def test_gguf_layers_of_wider_codes_serve_few_rows_on_the_kernel(monkeypatch, runs):
    from gguf import GGMLQuantizationType as Q

    from skyline.bench.gguf_blocks import random_blocks
    from skyline.ops import cpu_plan
    from skyline.quant.gguf import GGUFLinearMethod

    plan = cpu_plan.CpuPlan("avx512_bf16", torch.bfloat16, 8, 0, None, intdot_rows=2)
    monkeypatch.setattr(cpu_plan, "plan", lambda: plan)
    parts = [(Q[name], random_blocks(Q[name], 16, 512, 3 + i)) for i, name in enumerate(runs)]
    layer = _Layer(parts, 16 * len(runs), 512)
    method = GGUFLinearMethod()
    exact = method.dequantized_weight(layer)  # from the raw blocks
    assert method.prepack_cpu(layer, torch.bfloat16)
    w = layer.cpu_intdot
    assert w is not None and layer.cpu_planes is None and layer.cpu_plane_rows == 2
    # 5- and 6-bit types' codes in 6 bits, Q8_0's in 8
    assert w.bits == (8 if "Q8_0" in runs else 6) and w.group == (16 if "Q6_K" in runs else 32)
    if all(r.endswith("_K") for r in runs):
        # the file's scales as it holds them (an int8 per group, a float16 per 256): its
        # weights but for float32's rounding of q * scale + offset, ~0.6-1.1 bits a weight
        # more than the codes
        assert w.scale.dtype == torch.int8
        assert (cpu_intdot.dequantize(w) - exact).abs().max() <= 1e-6 * exact.abs().max()
        extra = 2 * 8 / w.group + 2 * 32 / 256
    else:
        # an fp16 scale and offset per 32 or 16: 1 or 2 bits a weight more than the codes
        assert w.scale.dtype == torch.float16
        assert (cpu_intdot.dequantize(w) - exact).abs().max() <= 1e-3 * exact.abs().max()
        extra = 2 * 16 / w.group
    assert method.decode_bytes(layer) == w.nbytes() <= (w.bits + extra) / 8 * exact.numel()
    x = torch.randn(2, 512).bfloat16()
    product, rows, native = method.cpu_decode_product(layer)
    assert native.kind == 1 and native.tensors[0] is w.codes
    assert rows == 2
    ref = cpu_intdot.intdot_mm_ref(x.float(), w)
    torch.testing.assert_close(product(x).float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max())
    torch.testing.assert_close(method.apply(layer, x), product(x))
    # more rows: the dense copy, as exact as bfloat16 allows
    x5 = torch.randn(5, 512)
    dense = method.apply(layer, x5.bfloat16()).float()
    ref5 = x5.bfloat16().float() @ exact.t()
    assert (dense - ref5).abs().max() < 2e-2 * ref5.abs().max()


@needs_kernel
@pytest.mark.parametrize("bits", [8, 6])
def test_a_gguf_head_runs_the_kernel_for_few_rows(bits):
    from skyline.model.layers.embedding import LMHead
    from skyline.model.loader import plain_layout

    head = LMHead(256, 64)
    head.weight.data = torch.randn(256, 64).bfloat16()
    head.code_bits = bits
    head.prepack(intdot_rows=2)
    assert head.intdot_weight is not None and head.intdot_rows == 2
    assert head.intdot_weight.bits == bits
    h = torch.randn(2, 64).bfloat16()
    logits = head(h)
    assert logits.dtype == torch.float32
    exact = h.float() @ head.weight.float().t()
    ref = cpu_intdot.intdot_mm_ref(h.float(), head.intdot_weight).float()
    near = exact >= exact.amax(-1, keepdim=True) - 7.5  # recomputed from the dense weight
    torch.testing.assert_close(logits[near], exact[near], rtol=1e-5, atol=1e-5)
    far = exact < exact.amax(-1, keepdim=True) - 8.5  # left as the kernel computed them
    torch.testing.assert_close(logits[far], ref[far], rtol=1e-5, atol=1e-4)
    # the kernel rounds the activations twice: within ~1e-4 of the 8-bit copy's exact product
    exact8 = h.float() @ cpu_intdot.dequantize(head.intdot_weight).t()
    assert (ref - exact8).abs().max() < 1e-3 * exact8.abs().max()
    assert head(torch.randn(3, 64).bfloat16()).shape == (3, 256)  # above: the dense head
    model = torch.nn.Sequential(head)
    plain_layout(model)
    assert head.intdot_weight is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [37], [5, 64, 17]], ids=str)
# (query heads, KV heads, block size): the 64-element path for 1-4 query heads a KV head, with
# 16-token score blocks in each cache block (16, 32) or none (8); 6 a KV head: the generic loops
@pytest.mark.parametrize("h,kvh,bs", [(9, 3, 16), (12, 3, 32), (4, 4, 8), (6, 3, 16), (12, 2, 16)],
                         ids=str)
def test_native_decode_attention_matches_the_reference(dtype, lens, h, kvh, bs):
    from skyline.ops.cpu_attention import decode_attention_cpu, decode_gather

    g = torch.Generator().manual_seed(len(lens))
    d, nb = 64, 24
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
    per_seq = -(-max(lens) // bs)
    tables = torch.randperm(nb, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
    qkv = torch.randn(len(lens), h + 2 * kvh, d, generator=g).to(dtype)
    q = qkv[:, :h]  # strided rows, as a projection's view
    gather = decode_gather(lens, tables.int(), bs)
    ref = decode_attention_cpu(q, cache, gather, 0.125)
    out = torch.ops.skyline_cpu.decode_attention(q, cache, gather.blocks.long(),
                                                 torch.tensor(lens), 0.125)
    assert out.dtype == dtype and out.shape == (len(lens), h, d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
