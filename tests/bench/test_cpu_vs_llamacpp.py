"""bench/cpu_vs_llamacpp.py --smoke: the skyline side of the comparison with llama.cpp (batch-1
decode, prefill, a few streams through `skyline serve`) runs without llama.cpp and writes its
JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skyline.config import ConfigError
from skyline.model.default import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_mode_runs_the_skyline_side(tmp_path):
    try:
        default_model_path()
    except ConfigError:
        pytest.skip("the default GGUF model is not installed")
    out = tmp_path / "cpu.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_vs_llamacpp.py"), "--smoke",
                    "--out", str(out), "--work-dir", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=600, capture_output=True)
    report = json.loads(out.read_text())
    assert report["cpu_plan"]["family"] and report["read_bandwidth_gb_s"] > 0
    (entry,) = report["models"].values()
    assert entry["skyline_defaults"]["dtype"] in ("float32", "bfloat16")
    assert entry["decode_b1_tok_s"]["skyline"][0] > 0 and entry["prefill_tok_s"]["skyline"][0] > 0
    assert entry["decode_floor_tok_s"]["skyline"] > 0
    serve = entry["serve"]["engines"]["skyline"]
    assert serve["completed"] == 2 and serve["failed"] == 0
    assert serve["output_throughput"] > 0 and serve["ttft_ms"]["median"] > 0
