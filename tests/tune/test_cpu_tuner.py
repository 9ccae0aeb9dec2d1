"""The CPU tuner's entry for the plan: a thread count among those it timed (none when --threads
fixes it) and int4 rows on the grid it measured, under the plan's family; timings not asserted."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from skyline.ops import cpu_int4, cpu_plan
from skyline.tune.cpu import ROWS, tune_cpu

ARCH = SimpleNamespace(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       head_dim=16)


def test_entry_for_the_plan_family():
    threads = torch.get_num_threads()
    out = tune_cpu(ARCH, batch=4, budget_s=1, smoke=True, log=lambda s: None)
    plan = cpu_plan.plan()
    entry = out[cpu_plan.KERNEL][plan.family]
    cores = os.cpu_count() or 1
    assert entry["threads"] in {1, max(1, cores // 2), cores, threads}  # the counts it timed
    assert torch.get_num_threads() == threads  # restored
    if plan.int4_rows > 0 and cpu_int4.has_kernel():
        assert entry["int4_rows"] in (0, *ROWS)
    else:
        assert "int4_rows" not in entry


def test_threads_given_are_not_tuned():
    out = tune_cpu(ARCH, batch=4, budget_s=1, smoke=True, threads=1, log=lambda s: None)
    assert "threads" not in out[cpu_plan.KERNEL][cpu_plan.plan().family]
