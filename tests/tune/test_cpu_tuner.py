"""The CPU tuner's entry for the plan: a thread count among those it timed (none when --threads
fixes it) and the rows of each kernel the plan runs on the grid it measured, under the plan's
family; timings not asserted."""

from __future__ import annotations

import os

import pytest
import torch

from skyline.config import ModelArch
from skyline.ops import cpu_int4, cpu_plan
from skyline.tune.cpu import ROWS, tune_cpu

ARCH = ModelArch(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
                 intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def test_entry_for_the_plan_family():
    threads = torch.get_num_threads()
    out = tune_cpu(ARCH, batch=4, budget_s=1, smoke=True, log=lambda s: None)
    plan = cpu_plan.plan()
    entry = out[cpu_plan.KERNEL][plan.family]
    cores = os.cpu_count() or 1
    assert entry["threads"] in {1, max(1, cores // 2), cores, threads}  # the counts it timed
    assert torch.get_num_threads() == threads  # restored
    if plan.int4_rows > 0 and (plan.int4_kernel == "intdot" or cpu_int4.has_kernel()):
        assert entry["int4_rows"] in (0, *ROWS)
    else:
        assert "int4_rows" not in entry
    if plan.intdot_rows > 0:
        assert entry["intdot_rows"] in (0, *ROWS)
    else:
        assert "intdot_rows" not in entry
    if plan.bf16_rows > 0:  # the bf16 kernel where activations are bfloat16 and it builds
        assert entry["bf16_rows"] in (0, *ROWS)
    else:
        assert "bf16_rows" not in entry


def test_each_kernel_the_plan_runs_is_measured(monkeypatch):
    # a plan with 4-bit codes on the integer dot kernel (AVX2's) measures it, not torch's
    from skyline.ops import cpu_intdot

    if not cpu_intdot.available():
        pytest.skip("the integer dot kernel does not build here")
    plan = cpu_plan.CpuPlan("avx2", torch.float32, 4, 0, None, 2, "intdot", 1)
    monkeypatch.setattr(cpu_plan, "plan", lambda: plan)
    lines = []
    entry = tune_cpu(ARCH, batch=4, budget_s=1, smoke=True, log=lines.append)[
        cpu_plan.KERNEL]["avx2"]
    assert {"int4_rows", "intdot_rows"} <= entry.keys()
    assert any("4-bit codes, intdot" in line for line in lines)
    assert any("8-bit codes, intdot" in line for line in lines)


def test_threads_given_are_not_tuned():
    out = tune_cpu(ARCH, batch=4, budget_s=1, smoke=True, threads=1, log=lambda s: None)
    assert "threads" not in out[cpu_plan.KERNEL][cpu_plan.plan().family]
