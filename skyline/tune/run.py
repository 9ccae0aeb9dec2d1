"""`skyline tune`: measure, rank, tune, re-measure, keep or revert, report (the package's
docstring says how). Writes this user's kernel cache (ops/tuning.py) and a JSON report."""

from __future__ import annotations

import dataclasses
import gc
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from skyline.bench.floor import copy_bandwidth, matmul_peak
from skyline.bench.offline import machine_info, save_json
from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.engine.create import resolve_device
from skyline.engine.frontend.llm import LLM
from skyline.ops import tuning
from skyline.tune import rank as ranking
from skyline.tune.loop import CacheFile, LoopSpec, Tuner, ranking_table, run_rounds
from skyline.tune.workload import Measurement, Workload, measure


@dataclass(frozen=True)
class TuneSpec:
    """What `skyline tune` was asked for (its flags besides the engine's)."""

    workload: Workload
    loop: LoopSpec
    out: str | None
    smoke: bool
    command: str


def run_tune(args: EngineArgs, spec: TuneSpec) -> dict[str, Any]:
    """One tune of this device for `args`' model; returns (and writes to spec.out) the
    report."""
    t0 = time.time()
    wl = spec.workload
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or args.placement:
        raise ConfigError("skyline tune measures one device; leave out --tensor-parallel-size, "
                          "--pipeline-parallel-size and --placement (each rank reads the tables "
                          "tuned for its own device)")
    args = dataclasses.replace(args, max_model_len=args.max_model_len or wl.max_model_len)
    where = resolve_device(args.device)
    on_gpu = where.startswith("cuda")
    device_type = "cuda" if on_gpu else "cpu"
    device = torch.cuda.get_device_name(where) if on_gpu else tuning.cpu_device_name()
    cache = CacheFile(tuning.user_config_path(device), device)
    cache.check()  # one sentence now, not after minutes of measuring
    peak, bandwidth = _peaks(where)
    llm = LLM(**dataclasses.asdict(args))
    arch, dtype = llm.config.model.arch, llm.config.model.dtype
    work = wl.work(llm.query("model_cost"))
    print(f"{device}: matmul peak {peak / 1e12:.3g} TFLOP/s, copy bandwidth "
          f"{bandwidth / 1e12:.3g} TB/s (measured now); tuned configs go to "
          f"{tuning.user_config_path(device)}", flush=True)

    def ranked(m: Measurement) -> list[dict[str, Any]]:
        phases = {p: ranking.by_family(k) for p, k in m.kernels.items()}
        return ranking.rank(phases, work, peak, bandwidth, device_type)

    first = measure(llm, wl, profile=True)
    _close(llm)
    del llm  # its memory before the next engine's
    rank_first = ranked(first)
    print(f"end to end {first.total_s:.4g} s ({_phases(first)})\n{ranking_table(rank_first)}",
          flush=True)
    seed = iter(range(1, 1 << 30))

    def remeasure() -> tuple[Measurement, list[dict[str, Any]]]:
        fresh = LLM(**dataclasses.asdict(args))  # reads the cache as it is now
        try:
            m = measure(fresh, wl, profile=True, seed=next(seed))
        finally:
            _close(fresh)
        print(f"end to end {m.total_s:.4g} s ({_phases(m)})", flush=True)
        return m, ranked(m)

    meta = {"date": _date(), "command": spec.command, "torch": torch.__version__,
            "triton": _triton_version()}
    rounds = run_rounds(spec.loop, first, rank_first, remeasure,
                        _tuners(device_type, arch, dtype, wl, spec.smoke), cache, meta)
    kept = [r for r in rounds if r["kept"]]
    final = kept[-1]["e2e_s_after"] if kept else first.total_s
    report = {
        "benchmark": "tune", "date": meta["date"], "command": spec.command, "device": device,
        "model": args.model, "machine": {**machine_info(where),
                                         "processor": platform.processor(),
                                         "triton": meta["triton"]},
        "matmul_peak_TFLOPs": peak / 1e12, "copy_bandwidth_TBps": bandwidth / 1e12,
        "workload": dataclasses.asdict(wl), "loop": dataclasses.asdict(spec.loop),
        "phase_s": first.phase_s, "e2e_s": first.total_s, "e2e_s_final": final,
        "speedup": first.total_s / final, "ranking": rank_first, "rounds": rounds,
        "cache_file": str(tuning.user_config_path(device)),
        "cache": tuning.tables(device), "wall_s": time.time() - t0,
    }
    print(f"end to end {first.total_s:.4g} s -> {final:.4g} s "
          f"({first.total_s / final:.3f}x); {len(kept)} of {len(rounds)} rounds kept")
    save_json(report, spec.out)
    return report


def _tuners(device_type: str, arch: Any, dtype: str, wl: Workload, smoke: bool
            ) -> dict[str, Tuner]:
    if device_type == "cpu":
        from skyline.tune.cpu import tune_cpu

        return {"cpu_linear": lambda row, left: tune_cpu(arch, wl.batch, left, smoke)}

    def gemv(row: dict[str, Any], left: float) -> dict[str, dict[str, dict[str, Any]]]:
        from skyline.bench.tuners import tune_device
        from skyline.tune.gemv import tune_model

        rows = [1] + ([wl.batch] if wl.batch > 1 else [])
        torch_dtype = getattr(torch, dtype)
        return tune_model(arch, rows, left, tune_device("skyline tune", smoke), torch_dtype)

    return {"gemv": gemv}


def _peaks(where: str) -> tuple[float, float]:
    dev = torch.device(where)
    peak, bandwidth = matmul_peak(dev), copy_bandwidth(dev, None if dev.type == "cuda" else 2**22)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return peak, bandwidth


def _close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _phases(m: Measurement) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in m.phase_s.items())


def _date() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _triton_version() -> str | None:
    mod = sys.modules.get("triton")
    if mod is None:
        try:
            import triton as mod  # noqa: PLC0415
        except ImportError:
            return None
    return getattr(mod, "__version__", None)
