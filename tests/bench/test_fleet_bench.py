"""bench/fleet.py --smoke: every stage runs end to end on the CPU and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_fleet_bench_smoke(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "fleet.py"), "--smoke", "--out-dir",
         str(out), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    routing = json.loads((out / "routing-smoke.json").read_text())
    assert set(routing["ratios"]) == {"shared-prefix", "multi-turn"}
    for row in routing["rows"].values():
        assert row["completed"] > 0 and row["failed"] == 0, row
    kill = json.loads((out / "kill-smoke.json").read_text())
    assert kill["cut_at_deadline"] == 0  # nothing hung
    assert kill["completed"] + kill["failed"] == kill["requests"]
    assert kill["completed"] >= kill["requests"] - 4  # only streams running on the victim fail
    overhead = json.loads((out / "overhead-smoke.json").read_text())
    assert overhead["rows"][0]["router_cpu_us_per_token"] > 0
