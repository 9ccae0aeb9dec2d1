"""Tune the quantized small-batch GEMV (skyline/ops/gemv_quant.py: FP8, INT8, INT4 weights) on
this GPU against the copy bandwidth measured in the same run.

  python bench/kernels/tune_gemv_quant.py      # llama-3.1-8b shapes, rows 1 2 4 8
  python bench/kernels/tune_gemv_quant.py --kinds int4 --rows 1 --budget-s 60
  python bench/kernels/tune_gemv_quant.py --smoke   # seconds, on the CPU (skyline/bench/tuners.py)

For each Linear shape of the model (qkv, o, gate_up, down, lm_head), weight kind, group size
(integer kinds) and row count, a small grid of launch configurations (BLOCK_N, BLOCK_K, SPLIT_K,
FMA or DOT mode, num_warps, num_stages, X_BCAST for integer FMA tiles, X_LEFT for INT4 DOT
tiles) is checked against the PyTorch reference and timed; the fastest goes into the tuning
tables "gemv_int8" / "gemv_int4" / "gemv_fp8a8" (fp8 x fp8, x quantized in the kernel) /
"gemv_fp8a8q" (x quantized per row before the call, outside the timing) / "gemv_int4a8" (INT4
against int8 x, ops/gemv_int_a8.py, x rounded before the call as the norm and SiLU kernels hand
it over, outside the timing;
`--configs-out`, default skyline/ops/configs/gemv-quant-<gpu>.json, also copied to $OUT when set).
Timing as in bench/kernels/tune_gemv.py: one CUDA graph of back-to-back calls cycling over enough
weight copies that L2 cannot serve them. Bandwidth fraction = weight + scale bytes / time / copy
bandwidth (read + write bytes of a 2 GiB device-to-device copy). A configuration that fails to
compile, run or match the reference is recorded and skipped; past `--budget-s` the remaining cells
keep the default configuration, timed once ("budget": true), so the run never aborts and stays
short.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from skyline.bench.tuners import interpret_for_smoke

interpret_for_smoke(sys.argv)  # before Triton loads

import torch  # noqa: E402

from skyline.bench import tuners  # noqa: E402
from skyline.bench.offline import machine_info, save_json  # noqa: E402
from skyline.ops.fp8_quant import quantize_rows_fp8  # noqa: E402
from skyline.ops.gemv_int_a8 import default_config as int4a8_default  # noqa: E402
from skyline.ops.gemv_int_a8 import (  # noqa: E402
    int4_gemv_a8,
    int4_gemv_a8_ref,
    round_to_int8_chunks,
)
from skyline.ops.gemv_quant import (  # noqa: E402
    FP8,
    INT4,
    INT8,
    KIND_NAMES,
    _pow2_divisor,
    config_key,
    default_config,
    fp8_gemv_a8,
    fp8_gemv_a8_ref,
    int_gemv,
    int_gemv_ref,
)
from skyline.ops.tuning import CONFIG_DIR, write_configs  # noqa: E402

FP8A8 = 3  # fp8 x fp8 (fp8_gemv_a8, x quantized in the kernel), tuned as kernel "gemv_fp8a8"
FP8A8Q = 4  # the same with x quantized per row beforehand: "gemv_fp8a8q"
INT4A8 = 5  # INT4 weights against int8 x by dp4a (ops/gemv_int_a8.py): "gemv_int4a8"
KINDS = {"int8": INT8, "int4": INT4, "fp8a8": FP8A8, "fp8a8q": FP8A8Q, "int4a8": INT4A8}
NAMES = {**KIND_NAMES, FP8A8: "fp8a8", FP8A8Q: "fp8a8q", INT4A8: "int4a8"}
# INT4A8 tiles (BLOCK_N, BLOCK_K, num_warps): registers only, no tensor cores, no pipelining,
# at least one 32-column chunk per thread (BLOCK_K >= 1,024 num_warps: below that the layout
# changes inside the K loop); each with and without the next tile's words loaded ahead
SMOKE_SHAPES = {(32, 128): ["llama-3.1-8b.qkv"]}
INT4A8_TILES = [(1, 4096, 4), (2, 4096, 4), (4, 4096, 4), (8, 4096, 4), (16, 4096, 4),
                (2, 2048, 2), (4, 2048, 2), (8, 2048, 2), (4, 8192, 8), (8, 8192, 8)]


def default(kind: int, m: int, n: int, k: int, group: int, num_sms: int) -> dict[str, Any]:
    if kind == INT4A8:
        return int4a8_default(m, n, k, num_sms)
    if kind in (FP8A8, FP8A8Q):
        return default_config(FP8, m, n, k, group, num_sms, a8=True)
    return default_config(kind, m, n, k, group, num_sms)


def candidates(kind: int, m: int, n: int, k: int, group: int, num_sms: int
               ) -> list[dict[str, Any]]:
    """A small grid for one cell: FMA tiles for up to four rows (at most 64 fp32 accumulators
    per thread), tensor-core tiles for every m; split K from 1 while each split keeps at least
    max(2, num_stages) K tiles and there are at most 16 waves of programs."""
    if kind == INT4A8:
        out = []
        for bn, bk, warps in INT4A8_TILES:
            for split in (1, 2, 4, 8):
                if split > 1 and (k // (split * bk) < 2 or -(-n // bn) * split > 16 * num_sms):
                    break
                for prefetch in (False, True):
                    out.append({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                                "num_warps": warps, "num_stages": 1, "PREFETCH": prefetch})
        base = default(kind, m, n, k, group, num_sms)
        return out + ([base] if base not in out else [])
    tiles: list[tuple[bool, int, int, int, int]] = []  # (dot, BLOCK_N, BLOCK_K, warps, stages)
    if kind in (FP8A8, FP8A8Q):  # tensor cores only: the tiles feed the MMA as loaded
        fma = []
        dot = [(64, 256, 4, 3), (128, 128, 4, 3), (32, 512, 4, 3), (64, 512, 4, 4),
               (128, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4)]
    else:
        bk = _pow2_divisor(group, 128)
        fma = [(32, bk, 4, 1), (16, bk, 4, 1), (32, bk, 4, 3)]
        dot = [(64, bk, 4, 3), (128, bk, 4, 3)]
    if m <= 4:
        tiles += [(False, bn, bk, w, s) for bn, bk, w, s in fma
                  if bn * m * bk // (32 * w) <= 64]
    if kind == INT4:  # INT4 tiles reach the tensor cores unpacked by bit operations alone
        dot += [(128, bk, 8, 3), (256, bk, 8, 3), (128, bk, 4, 4), (64, bk, 8, 3),
                (128, bk, 4, 1), (128, bk, 8, 1)]
    elif m <= 2 and kind == INT8:
        dot = dot[:1]  # FMA usually wins here; one tensor-core tile for comparison
    tiles += [(True, bn, bk, w, s) for bn, bk, w, s in dot if bk >= (32 if kind == INT4 else 16)]
    out, seen = [], set()
    for use_dot, bn, bk, warps, stages in tiles:
        programs = -(-n // bn)
        for split in (1, 2, 4, 8):
            if split > 1 and (k // (split * bk) < max(2, stages)
                              or programs * split > 16 * num_sms):
                break
            for bcast in [False, True] if not use_dot and m >= 2 else [False]:
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "USE_DOT": use_dot,
                       "num_warps": warps, "num_stages": stages,
                       "X_BCAST": not use_dot and bcast}
                out.append(cfg)
                seen.add(json.dumps(cfg, sort_keys=True))
                if kind == INT4 and use_dot:  # x as the left operand
                    out.append({**cfg, "X_LEFT": True})
    base = default(kind, m, n, k, group, num_sms)
    if json.dumps(base, sort_keys=True) not in seen:
        out.append(base)
    return out


def make_weights(kind: int, n: int, k: int, group: int, device: torch.device
                 ) -> tuple[tuple, int]:
    """Random quantized weights of one [n, k] Linear as the call's arguments after x, and their
    bytes (weights + scales + zeros)."""
    fmt = "fp8" if kind in (FP8A8, FP8A8Q) else "int8" if kind == INT8 else "int4"
    return tuners.random_quant_weights(fmt, n, k, group, device)


def call(kind: int, group: int, x: Any, args: tuple, cfg: dict | None) -> torch.Tensor:
    if kind == INT4A8:
        return int4_gemv_a8(x, *args, group, config=cfg)
    if kind == FP8A8:
        return fp8_gemv_a8(x, None, *args, config=cfg)
    if kind == FP8A8Q:  # x: (e4m3 rows, their scales)
        return fp8_gemv_a8(*x, *args, config=cfg)
    return int_gemv(x, *args, 4 if kind == INT4 else 8, group, config=cfg)


def reference(kind: int, group: int, x: Any, args: tuple, block_k: int = 0) -> torch.Tensor:
    if kind == INT4A8:
        return int4_gemv_a8_ref(x, *args, group)
    if kind == FP8A8:  # x rounded per row and BLOCK_K tile, as the kernel does
        return fp8_gemv_a8_ref(x, None, *args, block_k=block_k)
    if kind == FP8A8Q:
        return fp8_gemv_a8_ref(*x, *args)
    return int_gemv_ref(x, *args, 4 if kind == INT4 else 8, group)


def tune_cell(kind: int, n: int, k: int, group: int, rows: list[int], copy_bw: float,
              dev: tuners.TuneDevice, deadline: float) -> list[dict[str, Any]]:
    """The given row counts of one (kind, shape, group), on one set of weights."""
    num_sms = dev.num_sms
    args, nbytes = make_weights(kind, n, k, group, dev.device)
    num_copies = 1 if dev.out_dir else max(1, math.ceil(tuners.ROTATE_BYTES / nbytes))
    copies = [args] + [tuple(a.clone() for a in args) for _ in range(num_copies - 1)]
    calls = min(512, len(copies) * max(1, round(tuners.REPLAY_S * 4e12 / nbytes / len(copies))))
    calls = 1 if dev.out_dir else calls
    frac = lambda t: nbytes / t / copy_bw  # noqa: E731
    results = []
    for m in rows:
        x: Any = torch.randn(m, k, device=dev.device, dtype=torch.bfloat16)
        if kind == FP8A8Q:
            x = quantize_rows_fp8(x)
        ref = reference(kind, group, x, args, 128).float()
        if kind == INT4A8:  # x rounded beforehand, as the norm and SiLU kernels hand it over
            x = round_to_int8_chunks(x)
        tol = 1e-2 * ref.abs().max().item() + 1e-3
        base = default(kind, m, n, k, group, num_sms)
        over = time.time() > deadline
        cands = [base] if over else candidates(kind, m, n, k, group, num_sms)
        if dev.out_dir:
            cands = cands[:1] + [base]
        timed, failed = [], []
        for cfg in cands:
            try:
                want = ref
                if kind == FP8A8 and cfg["BLOCK_K"] != 128:
                    want = reference(kind, group, x, args, cfg["BLOCK_K"]).float()
                err = (call(kind, group, x, args, cfg).float() - want).abs().max().item()
                if not err <= tol:
                    raise AssertionError(f"max error {err:.3g} > {tol:.3g}")
                t = tuners.time_calls([lambda a=a, c=cfg, x=x: call(kind, group, x, a, c)
                                for a in copies], calls)
            except Exception as e:  # noqa: BLE001 - e.g. too much shared memory: skip, record
                failed.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            timed.append((t, cfg))
        res: dict[str, Any] = {
            "kind": NAMES[kind], "N": n, "K": k, "group": group, "rows": m,
            "key": config_key(m, n, k, group), "weight_MB": nbytes / 1e6, "budget": over,
            "num_timed": len(timed), "failed": failed}
        if timed:
            timed.sort(key=lambda tc: tc[0])
            t_best, best = timed[0]
            t_default = next((t for t, c in timed if c == base), None)
            res.update({
                "us": t_best * 1e6, "frac": frac(t_best), "config": best,
                "default_us": None if t_default is None else t_default * 1e6,
                "default_frac": None if t_default is None else frac(t_default),
                "timed": [{"us": t * 1e6, "frac": frac(t), "config": c} for t, c in timed]})
            print(f"{NAMES[kind]:>5} g{group:<4} {n:>6}x{k:<6} m={m}  {res['us']:7.1f} us "
                  f"({res['frac']:.2f} of copy bw)  default "
                  f"{res['default_us'] or float('nan'):7.1f} us  {best}", flush=True)
        else:
            print(f"{NAMES[kind]:>5} g{group:<4} {n:>6}x{k:<6} m={m}  no config ran: "
                  f"{failed[:1]}", flush=True)
        results.append(res)
    del copies, args
    if dev.device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def step_summary(shapes: dict[tuple[int, int], list[str]], results: list[dict[str, Any]],
                 model: str, copy_bw: float) -> dict[str, Any]:
    """Per kind, group and row count: the decode step's Linear layers (LM head apart) at the
    tuned configurations, as time and bandwidth fraction."""
    layers = tuners.shipped_config(model)["num_hidden_layers"]
    mine = [nk for nk, names in shapes.items() if not all(s.endswith("lm_head") for s in names)]
    by = {(r["kind"], r["group"], r["N"], r["K"], r["rows"]): r for r in results if "us" in r}
    out = {}
    for kind, group, m in sorted({(r["kind"], r["group"], r["rows"]) for r in results}):
        rs = [by.get((kind, group, n, k, m)) for n, k in mine]
        if any(r is None for r in rs):
            continue
        t = layers * sum(r["us"] for r in rs) / 1e6
        nbytes = layers * sum(r["weight_MB"] for r in rs) * 1e6
        out[f"{kind}:g{group}:m{m}"] = {"layers_weight_GB": nbytes / 1e9, "ms": t * 1e3,
                                        "frac": nbytes / t / copy_bw}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS),
                    default=["int4", "int8"])
    ap.add_argument("--groups", nargs="+", type=int, default=[128],
                    help="group sizes of the integer kinds (128 is the default group)")
    ap.add_argument("--rows", nargs="+", type=int, choices=[1, 2, 4, 8], default=[1, 2, 4, 8])
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="sweep time; later cells keep their default configuration")
    ap.add_argument("--configs-out", default=None,
                    help="tuning table to merge into (default "
                         "skyline/ops/configs/gemv-quant-<gpu>.json)")
    ap.add_argument("--report", default=None,
                    help="JSON report (default bench/results/kernels/gemv-quant-tune-<gpu>.json)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, a few configurations, on the CPU without a GPU")
    a = ap.parse_args()
    dev = tuners.tune_device("tune_gemv_quant", a.smoke)
    t0 = time.time()
    deadline = t0 + a.budget_s
    name, slug, num_sms = dev.name, dev.slug, dev.num_sms
    copy_bw = tuners.device_bandwidth(dev)
    print(f"{name}: copy bandwidth (read + write) {copy_bw / 1e12:.2f} TB/s, {num_sms} SMs")
    shapes = SMOKE_SHAPES if dev.out_dir else tuners.linear_shapes([a.model])
    if dev.out_dir:
        a.rows, a.groups, a.kinds = [1], [128], ["int4a8", "fp8a8", "fp8a8q", "int8", "int4"]
    # Row counts outermost (batch-1 decode first), so a short budget still tunes what matters.
    cells = [(m, KINDS[kd], n, k, 0 if kd.startswith("fp8") else g) for m in sorted(a.rows)
             for kd in a.kinds for g in ([0] if kd.startswith("fp8") else a.groups)
             for n, k in shapes]
    results = []
    for m, kind, n, k, group in cells:
        try:
            results += tune_cell(kind, n, k, group, [m], copy_bw, dev, deadline)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, go on
            print(f"{NAMES[kind]} {n}x{k} g{group} m={m}: {type(e).__name__}: {e}",
                  flush=True)
            results.append({"kind": NAMES[kind], "N": n, "K": k, "group": group, "rows": m,
                            "error": f"{type(e).__name__}: {e}"[:300]})
            if dev.device.type == "cuda":
                torch.cuda.empty_cache()
    command = "python " + " ".join(sys.argv)
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    tables: dict[str, dict[str, Any]] = {}
    for r in results:
        if "config" in r and not r["budget"]:
            tables.setdefault(f"gemv_{r['kind']}", {})[r["key"]] = r["config"]
    configs_out = dev.path(str(CONFIG_DIR / f"gemv-quant-{slug}.json"), a.configs_out)
    if tables:
        write_configs(configs_out, name, tables,
                      meta={"date": date, "command": command, "torch": torch.__version__,
                            "triton": tuners.triton_version()})
        print(f"wrote {configs_out}")
        tuners.copy_to_out(configs_out)
    report = {
        "benchmark": "tune_gemv_quant", "date": date, "command": command, "device": name,
        "model": a.model, "copy_bandwidth_TBps": copy_bw / 1e12, "num_sms": num_sms,
        "rotate_bytes": tuners.ROTATE_BYTES, "budget_s": a.budget_s, "wall_s": time.time() - t0,
        "decode_step_linears": step_summary(shapes, results, a.model, copy_bw),
        "shapes": results, "machine": machine_info(dev.device.type),
    }
    path = dev.path(os.path.join("bench/results/kernels", f"gemv-quant-tune-{slug}.json"),
                    a.report)
    save_json(report, path)
    tuners.copy_to_out(path)
    for key, s in report["decode_step_linears"].items():
        print(f"{key}: decode-step linears {s['layers_weight_GB']:.2f} GB  {s['ms']:.2f} ms "
              f"({s['frac']:.2f} of copy bw)")
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
