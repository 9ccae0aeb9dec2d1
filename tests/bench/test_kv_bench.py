"""The KV tiers' measurement scripts run end to end in their smoke modes."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def smoke(script: str, tmp_path) -> dict[str, Any]:
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, script, "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(out.read_text())


def test_kv_tiers_smoke(tmp_path):
    (row,) = smoke("bench/kv_tiers.py", tmp_path)["table"]
    assert row["setting"] == "ram" and row["completed"] == 8 and row["failed"] == 0
    assert row["ram_hit_rate"] > 0, row  # turns found their history in RAM


def test_long_prompt_smoke(tmp_path):
    res = smoke("bench/long_prompt.py", tmp_path)
    assert [run["kv_cache_dtype"] for run in res["runs"]] == ["auto", "fp8"]
    for run in res["runs"]:
        # the warm runs restored every block but the last partial one, from RAM then disk
        assert run["ram_tokens_loaded"] == run["disk_tokens_loaded"] == 240, run
        assert run["tokens"]["ram"] == run["tokens"]["disk"]
        assert 0 < run["cold_ttft_s"] and 0 < run["ram_ttft_s"] and 0 < run["disk_ttft_s"]
        # each TTFT's steps: the cold one's four chunks of 64; the warm ones' last 16 tokens
        steps = run["steps"]
        assert [s["prefill"] for s in steps["cold"]["slowest_steps"]] == [64] * 4, steps
        for k in ("ram", "disk"):
            assert steps[k]["steps"] == 1 and steps[k]["slowest_steps"][0]["prefill"] == 16
            assert steps[k]["seconds"] + steps[k]["outside_steps_s"] <= run[f"{k}_ttft_s"] + 1e-9
