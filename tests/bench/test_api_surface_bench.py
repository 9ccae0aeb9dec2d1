"""bench/api_surface.py --smoke: every stage runs, on the default model, in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_api_surface_smoke(tmp_path):
    out = tmp_path / "api.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "api_surface.py"), "--smoke",
                    "--out", str(out)], check=True, timeout=600, capture_output=True)
    res = json.loads(out.read_text())
    assert res["prompt_logprobs"]["scored_over_plain_k5"] > 0
    assert res["logit_bias"]["biased_over_plain"] > 0
    assert res["constrained"]["batch1"]["forced_ms_per_token"] > 0
