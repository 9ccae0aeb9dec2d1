"""The `skyline` command on the default model, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def _skyline(*args: str, stdin: str | None = None, timeout: float = 240):
    return subprocess.run([sys.executable, "-m", "skyline.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_and_chat():
    r = _skyline("generate", "What is the capital of France?", "--temperature", "0",
                 "--max-tokens", "30", "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    r = _skyline("chat", "--temperature", "0", "--max-tokens", "30", "--max-model-len", "512",
                 stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bench_offline_writes_json(tmp_path):
    out = tmp_path / "r.json"
    r = _skyline("bench", "offline", "--num-prompts", "3", "--input-len", "8", "--output-len",
                 "4", "--max-model-len", "64", "--output", str(out), "--floor",
                 "--temperature", "0.8", "--top-p", "0.9")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    assert res["skyline"]["num_output_tokens"] == 12 and res["skyline"]["output_tokens_per_s"] > 0
    # The floor, from the default model's layers: 30 layers of q, k, v, o (576 wide, 3 KV heads
    # of 64) and a 1536-wide MLP; the tied head 49152 x 576; K and V of 3 x 64 per layer.
    floor = res["floor"]
    assert floor["cost"]["linear_params"] == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert floor["cost"]["head_params"] == 49152 * 576
    assert floor["cost"]["kv_bytes_per_token"] % (2 * 30 * 3 * 64) == 0
    assert floor["concurrency"] == 3 and floor["decode_steps"] == 3
    # The overlapped floor is never above the sequential one; against the run's own time
    # either may pass 1 on a busy CPU (the peak and bandwidth are measured while it is busy).
    assert 0 < floor["fraction_of_overlapped"] <= floor["fraction_of_sequential"]
    # The step trace: one step prefills the three 8-token prompts (and samples each first
    # token), three decode steps of three rows read 9, 10 and 11 positions per sequence.
    steps = res["steps"]
    assert steps["mixed_prefill_tokens"] == 24 and steps["mixed_decode_tokens"] == 0
    assert steps["decode_steps"] == 3 and steps["decode_tokens"] == 9
    [bucket] = steps["decode_by_batch"]
    assert bucket["batch"] == "2-8" and bucket["mean_batch"] == 3 and bucket["mean_context"] == 10
    assert abs(steps["mixed_seconds"] + steps["decode_seconds"] - steps["seconds"]) < 1e-9


def test_bad_model_is_one_clear_line(tmp_path):
    r = _skyline("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("skyline: error:") and "not found" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    r = _skyline("generate", "hi", "--model", str(bad))
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
