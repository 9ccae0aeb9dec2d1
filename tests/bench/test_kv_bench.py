"""The KV tiers' measurement scripts run end to end in their smoke modes."""

from __future__ import annotations

import json
import subprocess
import sys


def test_kv_tiers_smoke(tmp_path):
    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, "bench/kv_tiers.py", "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    (row,) = res["table"]
    assert row["setting"] == "ram" and row["completed"] == 8 and row["failed"] == 0
    assert row["ram_hit_rate"] > 0, row  # turns found their history in RAM


def test_long_prompt_smoke(tmp_path):
    out = tmp_path / "long.json"
    r = subprocess.run([sys.executable, "bench/long_prompt.py", "--smoke", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [run["kv_cache_dtype"] for run in res["runs"]] == ["auto", "fp8"]
    for run in res["runs"]:
        # the warm runs restored every block but the last partial one, from RAM then disk
        assert run["ram_tokens_loaded"] == run["disk_tokens_loaded"] == 240, run
        assert run["tokens"]["ram"] == run["tokens"]["disk"]
        assert 0 < run["cold_ttft_s"] and 0 < run["ram_ttft_s"] and 0 < run["disk_ttft_s"]
