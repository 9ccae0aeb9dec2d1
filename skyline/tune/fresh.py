"""One measurement of the workload by a fresh engine in a process of its own: as a user starts
it, reading the kernel tables on disk as they are now (no lookup a dispatcher cached in this
process, no memory an earlier engine held), then exiting.

  python -m skyline.tune.fresh REQUEST.json RESULT.json

The request holds the engine's arguments, the workload and a seed; the result the phase times,
the profiled kernels, and what the parent needs to rank and tune (the model's cost, its
architecture, dtypes and device).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from skyline.config import ModelArch
from skyline.engine.args import EngineArgs
from skyline.engine.cost import ModelCost
from skyline.tune.workload import Measurement, Workload


@dataclasses.dataclass(frozen=True)
class Fresh:
    """A fresh engine's measurement and what it reported about itself."""

    measurement: Measurement
    cost: ModelCost
    arch: ModelArch
    dtype: str  # the model dtype, e.g. "bfloat16"
    kv_cache_dtype: str
    block_size: int
    device: str


def measure_fresh(args: EngineArgs, wl: Workload, seed: int, cache_dir: str,
                  timeout_s: float | None = None) -> Fresh:
    """Runs the child with the kernel cache `cache_dir`; raises RuntimeError with the end of
    its output when it fails."""
    with tempfile.TemporaryDirectory(prefix="skyline-tune-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"args": dataclasses.asdict(args),
                                   "workload": dataclasses.asdict(wl), "seed": seed}))
        root = str(Path(__file__).resolve().parents[2])  # this skyline, wherever it runs from
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "SKYLINE_KERNEL_CACHE": cache_dir, "PYTHONPATH": path}
        proc = subprocess.run([sys.executable, "-m", "skyline.tune.fresh", str(req), str(res)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if res.exists() and "error" in (out := json.loads(res.read_text())):
            raise ValueError(out["error"])  # a user's error (a flag, memory): its sentence
        if proc.returncode != 0 or not res.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            raise RuntimeError("the measuring engine failed (exit code "
                               f"{proc.returncode}):\n" + "\n".join(tail))
        out = json.loads(res.read_text())
    arch = out["arch"]
    arch = ModelArch(**{k: tuple(v) if isinstance(v, list) else v for k, v in arch.items()})
    return Fresh(Measurement(out["phase_s"], out["kernels"]), ModelCost(**out["cost"]), arch,
                 out["dtype"], out["kv_cache_dtype"], out["block_size"], out["device"])


def _child(request: str, result: str) -> None:
    from skyline.engine.frontend.llm import LLM
    from skyline.tune.workload import measure

    req = json.loads(Path(request).read_text())
    args = EngineArgs(**req["args"])
    try:
        llm = LLM(**dataclasses.asdict(args))
    except ValueError as e:  # ConfigError among them: one sentence for the parent to show
        Path(result).write_text(json.dumps({"error": str(e)}))
        sys.exit(1)
    try:
        m = measure(llm, Workload(**req["workload"]), profile=True, seed=req["seed"])
        cfg = llm.config
        out: dict[str, Any] = {
            "phase_s": m.phase_s, "kernels": m.kernels,
            "cost": dataclasses.asdict(llm.query("model_cost")),
            "arch": dataclasses.asdict(cfg.model.arch), "dtype": cfg.model.dtype,
            "kv_cache_dtype": cfg.cache.kv_cache_dtype, "block_size": cfg.cache.block_size,
            "device": cfg.device}
    finally:
        llm.shutdown()
    Path(result).write_text(json.dumps(out))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
