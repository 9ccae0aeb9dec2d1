"""bench/cpu_kernel_plan.py --smoke: the per-family kernel timings behind ops/cpu_plan.py run
(one emulated family, one thread, two row counts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
                    or not torch.backends.mkldnn.is_available(),
                    reason="needs torch's CPU int4 kernel and oneDNN")
def test_smoke_mode_times_each_kernel():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_kernel_plan.py"), "--smoke"],
                         check=True, cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert "fastest by rows" in out.stdout
    for kernel in ("int4_one_plane", "int4_two_planes", "dense_fp32"):
        assert kernel in out.stdout
