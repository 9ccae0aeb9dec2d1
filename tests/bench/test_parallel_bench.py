"""bench/parallel_overhead.py --smoke runs (CI keeps the script working)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_parallel_overhead_smoke(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "parallel_overhead.py"),
                    "--smoke", "--out", str(out)], check=True, timeout=300, cwd=ROOT)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["async_scheduling"]) for r in rows] == [
        (1, False), (1, True), (8, False), (8, True)]
    assert all(r["uni_tp1_ms"] > 0 and r["mp_tp2_ms"] > 0 and r["message_bytes"] > 0
               for r in rows)
