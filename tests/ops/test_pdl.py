"""Programmatic dependent launch: the kernels wait for their predecessor before touching memory
(checked in the sm_90 PTX, compiled without a GPU), PDL is off where it cannot apply, and on a
GPU a CUDA graph of PDL launches gives the results of plain launches."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from skyline import envs
from skyline.ops import pdl

triton = pytest.importorskip("triton")
if pdl.gdc_wait is None:
    pytest.skip("this Triton has no grid dependency control", allow_module_level=True)


# Compiled in a fresh interpreter: the test session runs kernels in Triton's interpreter, whose
# functions cannot be compiled for a target.
_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from skyline.ops.norm import _rms_norm_kernel
sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
       "eps": "fp32", "num_rows": "i32", "num_heads": "i32", "d": "i32", "stride_xt": "i32",
       "stride_xh": "i32", "stride_rt": "i32", "stride_ot": "i32", "stride_oh": "i32"}
const = {"HAS_RESIDUAL": True, "BLOCK_M": 1, "BLOCK_N": 1024, "PDL": sys.argv[1] == "1"}
sig.update({k: "constexpr" for k in const})
names = list(sig)
src = ASTSource(fn=_rms_norm_kernel, signature=sig,
                constexprs={(names.index(k),): v for k, v in const.items()})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
"""


def _ptx(enabled: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, "1" if enabled else "0"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_kernel_waits_before_its_first_load():
    ptx = _ptx(True)
    wait = ptx.index("griddepcontrol.wait")
    assert "griddepcontrol.launch_dependents" in ptx
    first_global = re.search(r"\b(ld|st)\.global", ptx)
    assert first_global is not None and wait < first_global.start()
    assert "griddepcontrol" not in _ptx(False)


def test_off_without_a_hopper_gpu(monkeypatch):
    assert not pdl.use_pdl(torch.device("cpu"))
    pdl._enabled.cache_clear()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # only SKYLINE_PDL says no here
    monkeypatch.setenv("SKYLINE_PDL", "0")
    monkeypatch.setattr(envs, "ENV", envs.Env.read())
    try:
        assert not pdl._enabled(0)
    finally:
        pdl._enabled.cache_clear()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_of_pdl_launches_matches_plain_launches(monkeypatch):
    from skyline.ops.activation import silu_and_mul
    from skyline.ops.gemv import gemv
    from skyline.ops.norm import fused_add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    w_up = torch.randn(2 * 2048, 1024, device="cuda", generator=gen, dtype=torch.bfloat16) / 32
    w_down = torch.randn(1024, 2048, device="cuda", generator=gen, dtype=torch.bfloat16) / 45
    g = torch.rand(1024, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    x0 = torch.randn(1, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)

    def layers(x, res):
        for _ in range(8):  # a chain of dependent launches, each reading the previous output
            h, res = fused_add_rms_norm(x, res, g, 1e-6)
            x = gemv(silu_and_mul(gemv(h, w_up)), w_down)
        return x + res

    def run(enabled: bool) -> torch.Tensor:
        pdl._enabled.cache_clear()
        monkeypatch.setenv("SKYLINE_PDL", "1" if enabled else "0")
        monkeypatch.setattr(envs, "ENV", envs.Env.read())
        assert pdl.use_pdl(x0.device) == (enabled and torch.cuda.get_device_capability()[0] >= 9)
        x, res = x0.clone(), torch.zeros_like(x0)
        layers(x.clone(), res.clone())  # compile and allocate the split-K counters
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layers(x, res)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    try:
        assert torch.equal(run(True), run(False))
    finally:
        pdl._enabled.cache_clear()
