"""Every bench script (bench/*.py, bench/kernels/*.py) runs in its --smoke mode: a tiny random
model or tiny kernel shapes on the CPU, seconds each, so a script that rots fails here. Each
runs in a fresh process, in a temporary directory (nothing it writes lands in the repo).
Scripts whose smoke run has a test of its own, which also checks what it wrote, run there
only (OWN_TEST)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*BENCH.glob("*.py"), *(BENCH / "kernels").glob("*.py")])
OWN_TEST = {
    "fast_start.py": "bench/test_fast_start_bench.py",
    "fleet.py": "bench/test_fleet_bench.py",
    "fused_vs_modular.py": "bench/test_fused_bench.py",
    "kv_tiers.py": "bench/test_kv_bench.py",
    "long_prompt.py": "bench/test_kv_bench.py",
    "moe.py": "bench/test_moe_bench.py",
    "moe_gemv_speed.py": "bench/test_moe_bench.py",
    "moe_grouped_speed.py": "bench/test_moe_bench.py",
    "parallel_overhead.py": "bench/test_parallel_bench.py",
    "serve_ceiling.py": "server/test_served_speed.py",
    "served_vs_offline.py": "server/test_served_speed.py",
}


def test_every_script_is_here():
    assert len(SCRIPTS) > 20 and BENCH / "kernels" / "tune_gemv.py" in SCRIPTS
    for script, test in OWN_TEST.items():
        assert script in {s.name for s in SCRIPTS} and script in (TESTS / test).read_text(), \
            script


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.name not in OWN_TEST],
                         ids=lambda p: str(p.relative_to(BENCH)))
def test_smoke(script: Path, tmp_path: Path):
    # The scripts choose Triton's interpreter themselves (the PTX counters must not have it).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TMPDIR": str(tmp_path), "OUT": ""}
    r = subprocess.run([sys.executable, str(script), "--smoke"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{script.name} --smoke failed:\n{r.stdout[-2000:]}\n" \
                              f"{r.stderr[-4000:]}"
