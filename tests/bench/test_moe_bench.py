"""bench/moe.py --smoke: every stage for both MoE models, shrunk, on the CPU (the kernel stage
runs bench/kernels/moe_gemv_speed.py and moe_grouped_speed.py --smoke --tune, in Triton's
interpreter where triton is installed)."""

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
    kernel = tmp_path / "kernel-smoke.json"
    try:
        import triton  # noqa: F401
    except ImportError:
        assert not kernel.exists() and not (tmp_path / "grouped-smoke.json").exists()
    else:
        rows = json.loads(kernel.read_text())["rows"]
        assert {r["fmt"] for r in rows} == {"dense", "mxfp4"}
        assert all(r["gemv_us"] > 0 and r["grouped_us"] > 0 and r["tuned_us"] > 0 for r in rows)
        grouped = json.loads((tmp_path / "grouped-smoke.json").read_text())
        assert {(r["model"], r["fmt"]) for r in grouped["rows"]} == {
            ("gpt-oss-20b", "mxfp4"), ("gpt-oss-20b", "dense")}
        assert all(r["ms"] > 0 and r["floor_ms"] > 0 and r["tuned_ms"] > 0
                   and r["tuned"]["BLOCK_M"] for r in grouped["rows"])
    for model in ("qwen3-30b-a3b", "gpt-oss-20b"):
        dec = json.loads((tmp_path / f"decode-{model}-smoke.json").read_text())
        assert dec["decode_tok_s"] > 0 and dec["roofline_tok_s"] > 0
        assert 0 < dec["cost"]["expert_fraction"] < 1
        off = json.loads((tmp_path / f"offline-{model}-smoke.json").read_text())
        assert off["skyline"]["num_output_tokens"] == 16 and off["floor"]["sequential_s"] > 0
        eng = off["engine"]
        assert eng["kv_cache_gib"] > 0 and eng["num_preemptions"] >= 0
        assert eng["memory_in_use_gib"] == 0 and eng["profile_peak_gib"] == 0  # CPU: unused
        assert f"{model} offline:" in r.stdout and "preemptions" in r.stdout
    assert dec["experts"] == "mxfp4"  # gpt-oss: its experts as the checkpoint ships them


def test_moe_bench_smoke_with_experts_on_the_cpu(tmp_path):
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "bench" / "moe.py"), "--smoke", "--stages",
                        "decode", "--models", "qwen3-30b-a3b", "--n-cpu-moe", "1",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    dec = json.loads((tmp_path / "decode-qwen3-30b-a3b-smoke-cpu-moe-1.json").read_text())
    assert dec["n_cpu_moe"] == 1 and dec["decode_tok_s"] > 0
    # one of the two layers' experts in host memory: half of them, a share read a token
    assert abs(dec["host_experts_GB"] * 2 - dec["all_experts_GB"]) < 1e-6
    assert dec["host_bytes_per_token_GB"] > 0 and dec["floor_host_ms"] > 0
    assert dec["host_bandwidth_GBps"] > 0
