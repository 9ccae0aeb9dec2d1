"""bench/dummy_tokenizer.py --weights: a checkpoint of random weights in the asked dtype that
skyline loads as a user's (its config names the dtype)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from skyline.bench.dummy_model import tiny_model_dir
from skyline.engine.create import EngineArgs, create_engine_config

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "dummy_tokenizer.py"


def test_random_weights_in_the_asked_dtype(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bf16"
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", tiny_model_dir(str(tmp_path)),
                        "--weights", "bfloat16", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}
    cfg, _ = create_engine_config(EngineArgs(model=str(out), device="cpu", dtype="bfloat16"))
    assert cfg.model.dtype == "bfloat16"
    # the weights load and run
    from skyline.engine.frontend.llm import LLM
    from skyline.types import SamplingParams

    llm = LLM(model=str(out), device="cpu", dtype="bfloat16", max_model_len=64)
    try:
        [res] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(res.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
