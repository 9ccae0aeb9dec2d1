"""`skyline tune`: measure, rank, tune, re-measure, keep or revert, report (the package's
docstring says how). Writes this user's kernel cache (ops/tuning.py) and a JSON report.

Every measurement is a fresh engine in a process of its own (fresh.py), which reads the tables
as they are on disk; this process measures the device's peaks and runs the kernel tuners."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from skyline import envs
from skyline.bench.floor import copy_bandwidth, matmul_peak
from skyline.bench.offline import machine_info, save_json
from skyline.config import ConfigError
from skyline.engine.args import EngineArgs
from skyline.engine.create import create_engine_config, resolve_device
from skyline.ops import tuning
from skyline.tune import rank as ranking
from skyline.tune.fresh import Fresh, measure_fresh
from skyline.tune.loop import CacheFile, LoopSpec, Tuner, ranking_table, run_rounds
from skyline.tune.workload import Measurement, Workload


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
    check_out(spec.out)  # one sentence now, not after minutes of measuring
    check_workload(args, wl)
    args = dataclasses.replace(args, max_model_len=args.max_model_len or wl.max_model_len)
    where = resolve_device(args.device)
    on_gpu = where.startswith("cuda")
    device_type = "cuda" if on_gpu else "cpu"
    device = torch.cuda.get_device_name(where) if on_gpu else tuning.cpu_device_name()
    cache = CacheFile(tuning.user_config_path(device), device)
    cache.check()  # one sentence now, not after minutes of measuring
    peak, bandwidth = _peaks(where)
    print(f"{device}: matmul peak {peak / 1e12:.3g} TFLOP/s, copy bandwidth "
          f"{bandwidth / 1e12:.3g} TB/s (measured now); tuned configs go to {cache.path}",
          flush=True)
    seeds = iter(range(1 << 30))

    def fresh() -> Fresh:
        if on_gpu:
            torch.cuda.empty_cache()  # what the tuners held, for the measuring engine
        f = measure_fresh(args, wl, next(seeds), envs.ENV.kernel_cache_dir)
        m = f.measurement
        print(f"end to end {m.total_s:.4g} s ({_phases(m)})", flush=True)
        return f

    first = fresh()
    work = wl.work(first.cost)

    def ranked(m: Measurement) -> list[dict[str, Any]]:
        phases = {p: ranking.by_family(k) for p, k in m.kernels.items()}
        return ranking.rank(phases, work, peak, bandwidth, device_type)

    def remeasure() -> tuple[Measurement, list[dict[str, Any]]]:
        m = fresh().measurement
        return m, ranked(m)

    rank_first = ranked(first.measurement)
    print(ranking_table(rank_first), flush=True)
    meta = {"date": _date(), "command": spec.command, "torch": torch.__version__,
            "triton": _triton_version()}
    rounds = run_rounds(spec.loop, first.measurement, rank_first, remeasure,
                        _tuners(device_type, first, wl, spec.smoke, args), cache, meta)
    kept = [r for r in rounds if r["kept"]]
    e2e = first.measurement.total_s
    final = kept[-1]["e2e_s_after"] if kept else e2e
    report = {
        "benchmark": "tune", "date": meta["date"], "command": spec.command, "device": device,
        "model": args.model, "machine": {**machine_info(where), "processor": platform.processor(),
                                         "triton": meta["triton"]},
        "matmul_peak_TFLOPs": peak / 1e12, "copy_bandwidth_TBps": bandwidth / 1e12,
        "workload": dataclasses.asdict(wl), "loop": dataclasses.asdict(spec.loop),
        "phase_s": first.measurement.phase_s, "e2e_s": e2e, "e2e_s_final": final,
        "speedup": e2e / final, "ranking": rank_first, "rounds": rounds,
        "cache_file": str(cache.path), "cache": tuning.tables(device),
        "wall_s": time.time() - t0,
    }
    print(f"end to end {e2e:.4g} s -> {final:.4g} s ({e2e / final:.3f}x); {len(kept)} of "
          f"{len(rounds)} rounds kept")
    save_json(report, spec.out)
    return report


def check_workload(args: EngineArgs, wl: Workload) -> None:
    """Raise ConfigError if the workload cannot run as asked (a context of 10^8 tokens built
    its prompts for minutes; a batch beyond --max-num-seqs would time waves, not a batch)."""
    config, _ = create_engine_config(args)
    limit = args.max_model_len or config.model.arch.max_position_embeddings
    if wl.max_model_len > limit:
        raise ConfigError(
            f"--prefill-len {wl.prefill_len} / --context {wl.context} with --decode-steps "
            f"{wl.decode_steps} need {wl.max_model_len} tokens of context, and "
            f"{'--max-model-len' if args.max_model_len else 'the model'} allows {limit}; "
            "lower them")
    if wl.batch > config.scheduler.max_num_seqs:
        raise ConfigError(f"--batch {wl.batch} is more sequences than the engine runs at once "
                          f"(--max-num-seqs {config.scheduler.max_num_seqs}); lower --batch or "
                          "raise --max-num-seqs")


def check_out(path: str | None) -> None:
    """Raise ConfigError if the report cannot be written to `path` (left as it was)."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"--out {path} is a folder; give a file name, e.g. "
                          f"{os.path.join(path, 'tune.json')}")
    existed = os.path.exists(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ConfigError(f"cannot write the report to --out {path} ({e.strerror or e}); give "
                          "a path in a folder you can write") from None


def _tuners(device_type: str, first: Fresh, wl: Workload, smoke: bool, args: EngineArgs
            ) -> dict[str, Tuner]:
    if device_type == "cpu":
        from skyline.tune.cpu import tune_cpu

        return {"cpu_linear": lambda row, left: tune_cpu(first.arch, wl.batch, left, smoke,
                                                         args.threads)}

    from skyline.bench.tuners import tune_device

    def gemv(row: dict[str, Any], left: float) -> dict[str, dict[str, dict[str, Any]]]:
        from skyline.tune.gemv import tune_model

        rows = [1] + ([wl.batch] if wl.batch > 1 else [])
        return tune_model(first.arch, rows, left, tune_device("skyline tune", smoke),
                          getattr(torch, first.dtype))

    def attention(row: dict[str, Any], left: float) -> dict[str, dict[str, dict[str, Any]]]:
        from skyline.tune.attention import tune_model

        return tune_model(first.arch, first.kv_cache_dtype, first.block_size,
                          sorted({1, wl.batch}), [wl.context], left,
                          tune_device("skyline tune", smoke), prefill_len=wl.prefill_len)

    def gemv_block(row: dict[str, Any], left: float) -> dict[str, dict[str, dict[str, Any]]]:
        from skyline.tune.gemv_block import formats_of, tune_model

        return tune_model(first.arch, formats_of(args.quantization, args.model),
                          [1] + ([wl.batch] if wl.batch > 1 else []), left,
                          tune_device("skyline tune", smoke), getattr(torch, first.dtype))

    return {"gemv": gemv, "attention": attention, "gemv_block": gemv_block}


def _peaks(where: str) -> tuple[float, float]:
    dev = torch.device(where)
    peak, bandwidth = matmul_peak(dev), copy_bandwidth(dev, None if dev.type == "cuda" else 2**22)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return peak, bandwidth


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
