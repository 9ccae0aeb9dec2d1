"""bench/fused_vs_modular.py --smoke: one engine on the CPU times every step shape fused, then
with each fusion of the model unfused through the engine query, then fused again; the kernels
alone; and writes the table's rows, the floors and a verdict per fusion to its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fused_vs_modular_smoke(tmp_path):
    out = tmp_path / "fused.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "fused_vs_modular.py"), "--smoke",
         "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    names = ["norm", "rope_kv", "silu", "argmax", "pdl"]  # a Llama in bf16: no MoE, no qk norm
    assert list(res["verdicts"]) == names and set(res["verdicts"].values()) <= {"keep", "drop"}
    shapes = {"decode1", "decode4", "prefill64"}
    assert set(res["floors_ms"]) == shapes and all(v > 0 for v in res["floors_ms"].values())
    assert {(r["fusion"], r["shape"]) for r in res["rows"]} == {
        (n, s) for n in names for s in shapes}
    for r in res["rows"] + res["kernels"]:
        assert r["fused_ms"] > 0 and r["unfused_ms"] > 0
        assert r["verdict"] == ("keep" if r["ratio"] > 1.02 else
                                "drop" if r["ratio"] < 0.98 else "tie")
    assert {r["fusion"] for r in res["kernels"]} == {"norm", "rope_kv", "silu", "qkv",
                                                      "gate_up", "argmax"}
    assert "fusion" in proc.stdout and "verdicts: norm" in proc.stdout  # the table is printed
