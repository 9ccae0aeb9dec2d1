"""bench/fast_start.py --smoke: each start's phases (the engine built in a fresh process, and a
`skyline serve` process to its first 200 on /health), with Triton's cache empty and filled, and
the phases add up to the start's time as measured from outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_fast_start_smoke(tmp_path: Path):
    out = tmp_path / "fast-start.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, str(BENCH / "fast_start.py"), "--smoke", "--out",
                        str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    res = json.loads(out.read_text())
    assert set(res["engine"]) == {"empty", "filled"} and set(res["serve"]) == {"empty"}
    for run in res["engine"].values():
        phases = run["phases_s"]
        assert list(phases)[:3] == ["imports", "config", "tokenizer"]
        assert {"load_weights", "profile", "kv_cache", "engine_other"} <= set(phases)
        assert sum(phases.values()) == pytest.approx(run["engine_ready_s"], rel=0.02, abs=0.02)
        assert run["engine_ready_s"] <= run["process_wall_s"]
    for run in res["serve"].values():
        phases = run["phases_s"]
        assert list(phases)[:3] == ["api_imports", "spawn", "imports"]
        assert {"config", "load_weights", "tokenizer", "api_server"} <= set(phases)
        # the log's phases against the outside clock: nothing large unrecorded
        assert -0.1 < run["unrecorded_s"] < 0.25 + 0.1 * run["health_s"], run
    assert res["engine_ready_s"] == res["engine"]["filled"]["engine_ready_s"]
