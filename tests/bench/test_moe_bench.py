"""bench/moe.py --smoke: both stages for both MoE models, shrunk, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_moe_bench_smoke(tmp_path):
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "moe.py"), "--smoke", "--out-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    for model in ("qwen3-30b-a3b", "gpt-oss-20b"):
        dec = json.loads((tmp_path / f"decode-{model}-smoke.json").read_text())
        assert dec["decode_tok_s"] > 0 and dec["roofline_tok_s"] > 0
        assert 0 < dec["cost"]["expert_fraction"] < 1
        off = json.loads((tmp_path / f"offline-{model}-smoke.json").read_text())
        assert off["skyline"]["num_output_tokens"] == 16 and off["floor"]["sequential_s"] > 0
    assert dec["experts"] == "mxfp4"  # gpt-oss: its experts as the checkpoint ships them
